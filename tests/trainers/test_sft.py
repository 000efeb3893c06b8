import json
import math
import random

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.engine.optim import lr_factor
from posttrain.ops.masked import masked_count
from posttrain.tasks.arithmetic import sft_rows
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.sft import (
    SFTTrainer,
    collate_sft,
    length_grouped_batches,
    sft_nll_sum,
    tokenize_sft_rows,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny(tokenizer, seed=0):
    return build_tiny_llama(tokenizer, hidden_size=32, num_layers=1, num_heads=2,
                            intermediate_size=64, max_position_embeddings=128, seed=seed)


def test_tokenize_appends_eos_and_records_prompt_length(tokenizer):
    examples, skipped = tokenize_sft_rows(tokenizer, [{"prompt": "1+2", "completion": "3"}], 64)
    ids, prompt_len = examples[0]
    # "<s>1+2\n" is 5 tokens, then "3" and "</s>"
    assert prompt_len == 5 and skipped == 0
    assert tokenizer.decode(ids) == "<s>1+2\n3</s>"
    cut, skipped = tokenize_sft_rows(tokenizer, [{"prompt": "1+2", "completion": "345"},
                                                 {"prompt": "123456", "completion": "7"}], 6)
    assert skipped == 1 and cut[0] == (ids[:5] + tokenizer("3", add_special_tokens=False)[
        "input_ids"], 5)


def test_collate_splits_prompts_left_and_completions_right_padded():
    batch = collate_sft([([1, 5, 6, 7], 2), ([1, 5, 6], 1)], pad_id=0)
    assert batch["prompt_ids"].tolist() == [[1, 5], [0, 1]]
    assert batch["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert batch["completion_ids"].tolist() == [[6, 7], [5, 6]]
    assert batch["response_mask"].tolist() == [[1, 1], [1, 1]]
    ragged = collate_sft([([1, 5, 6, 7], 3), ([1, 5, 6], 1)], pad_id=9)
    assert ragged["completion_ids"].tolist() == [[7, 9], [5, 6]]
    assert ragged["response_mask"].tolist() == [[1, 0], [1, 1]]


def test_uniform_logits_give_log_vocab_per_token(tokenizer):
    model = tiny(tokenizer)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: each token has probability 1/V
    batch = collate_sft([([1, 5, 6, 7], 2), ([1, 5, 6], 1)], pad_id=0)
    nll, count = sft_nll_sum(model, batch)
    # completion tokens: row 0 -> 6, 7; row 1 -> 5, 6: four tokens, each -log(1/V)
    V = model.config.vocab_size
    assert count.item() == 4
    assert nll.item() == pytest.approx(4 * math.log(V), rel=1e-6)


def test_padding_has_no_effect_and_completion_targets_do(tokenizer):
    """Masked positions (padding of either side, whatever its id) change neither the loss nor
    the gradient; a changed completion token changes the loss."""
    examples = [([1, 2, 3, 4, 5, 6], 3), ([1, 2, 3, 4], 2)]
    grads, nlls = [], []
    for pad in (0, 7):
        model = tiny(tokenizer)
        nll, _ = sft_nll_sum(model, collate_sft(examples, pad_id=pad))
        nll.backward()
        nlls.append(nll.item())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert nlls[0] == pytest.approx(nlls[1], abs=1e-6)
    for g, h in zip(*grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)
    changed = [([1, 2, 3, 4, 5, 9], 3), ([1, 2, 3, 4], 2)]
    assert sft_nll_sum(tiny(tokenizer), collate_sft(changed, 0))[0].item() != pytest.approx(
        nlls[0])


def test_length_grouped_batches_cover_each_index_once():
    lengths = [random.Random(i).randint(5, 50) for i in range(1000)]
    batches = length_grouped_batches(lengths, 16, random.Random(0), window=8)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(1000))
    assert all(len(b) <= 16 for b in batches)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    assert spread / len(batches) < 10  # random batches of 16 from 5..50 spread ~40


def test_lr_factor_golden():
    # warmup 10: step 0 -> 1/10, step 9 -> 10/10
    assert lr_factor(0, 110, 10, "cosine") == pytest.approx(0.1)
    assert lr_factor(9, 110, 10, "cosine") == pytest.approx(1.0)
    # cosine halfway (step 60 of 10..110): 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lr_factor(60, 110, 10, "cosine", min_ratio=0.1) == pytest.approx(0.55)
    assert lr_factor(60, 110, 10, "cosine") == pytest.approx(0.5)  # floor 0: 0.5 * (1 + 0)
    assert lr_factor(110, 110, 10, "linear", min_ratio=0.0) == pytest.approx(0.0)
    assert lr_factor(50, 110, 10, "constant") == 1.0
    with pytest.raises(ValueError, match="valid"):
        lr_factor(0, 10, 0, "exp")


def backward_batch(model, parts):
    """The mean completion-token NLL over micro-batches `parts`, its gradient accumulated
    (each part's summed NLL divided by the count of all of them)."""
    n_tokens = sum(float(masked_count(p["response_mask"])) for p in parts)
    total = torch.zeros(())
    for part in parts:
        nll, _ = sft_nll_sum(model, part)
        (nll / max(n_tokens, 1.0)).backward()
        total += nll.detach().cpu()
    return total / max(n_tokens, 1.0)


def test_micro_batches_give_the_same_gradient(tokenizer):
    examples, _ = tokenize_sft_rows(tokenizer, sft_rows(8, seed=0), 96)
    grads, losses = [], []
    for micro in (8, 3):
        model = tiny(tokenizer)
        parts = [collate_sft(examples[a : a + micro], 0) for a in range(0, 8, micro)]
        losses.append(backward_batch(model, parts))
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[0], losses[1])
    for g, h in zip(*grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-4)


def test_tiny_sft_run_lowers_loss(tokenizer, tmp_path):
    """The Python API: model and tokenizer objects, rows as a list, config keys as keywords."""
    model = tiny(tokenizer)
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_data=sft_rows(512, seed=0),
                         out_dir=str(tmp_path), max_steps=60, batch_size=16, lr=3e-3,
                         warmup_steps=5, log_every=20, rewards=[], progress=False, threads=1,
                         report_to=[])
    result = trainer.train()
    assert result["train"]["loss_last"] < 0.6 * result["train"]["loss_first"]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in logged if "loss/sft" in r]
    assert steps == [20, 40, 60]
    assert all("eval/accuracy" not in r for r in logged)  # rewards: [] -> no greedy eval
    assert trainer.model is model


def test_sft_lr_warmup_and_betas_come_from_the_config(tokenizer, tmp_path):
    trainer = SFTTrainer(model=tiny(tokenizer), tokenizer=tokenizer, train_data=sft_rows(64),
                         out_dir=str(tmp_path), max_steps=3, batch_size=8, lr=3e-3,
                         warmup_steps=5, adam_betas=[0.8, 0.9], rewards=[], progress=False,
                         report_to=[])
    assert trainer.opt.param_groups[0]["betas"] == (0.8, 0.9)
    metrics = trainer.step(1)
    assert metrics["train/lr"] == pytest.approx(3e-3 / 5)  # warm-up step 0 of 5: lr * 1/5


def test_bad_arguments(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="max_seq_len"):
        SFTTrainer(model=tiny(tokenizer), tokenizer=tokenizer, out_dir=str(tmp_path),
                   train_data=[{"prompt": "1+2+3", "completion": "6"}], max_seq_len=3, rewards=[])
    with pytest.raises(ConfigError, match="batch_size"):
        SFTTrainer(model=tiny(tokenizer), tokenizer=tokenizer, out_dir=str(tmp_path),
                   train_data=sft_rows(4), batch_size=0, rewards=[])
