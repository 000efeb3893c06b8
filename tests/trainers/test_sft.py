import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.models import build_char_tokenizer, build_tiny_llama
from posttrain.tasks.arithmetic import sft_rows
from posttrain.trainers.common import lr_factor
from posttrain.trainers.sft import (
    SFTTrainer,
    backward_batch,
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


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits ignore the input, so targets are the only thing that varies."""

    def __init__(self, batch: int, length: int, vocab: int) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(batch, length, vocab))

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.logits[:, : input_ids.shape[1]])


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


def test_collate_right_pads_and_masks_completion():
    batch = collate_sft([([1, 5, 6, 7], 2), ([1, 5, 6], 1)], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7], [1, 5, 6, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 0]]


def test_uniform_logits_give_log_vocab_per_token():
    model = FixedLogits(2, 4, 10)
    with torch.no_grad():
        model.logits.zero_()
    batch = collate_sft([([1, 5, 6, 7], 2), ([1, 5, 6], 1)], pad_id=0)
    nll, count = sft_nll_sum(model, batch)
    # completion tokens: row 0 -> 6, 7; row 1 -> 5, 6: four tokens, each -log(1/10)
    assert count.item() == 4
    assert nll.item() == pytest.approx(4 * math.log(10))


def test_prompt_and_padding_targets_do_not_affect_loss_or_gradient():
    torch.manual_seed(0)
    model = FixedLogits(2, 6, 10)
    a = collate_sft([([1, 2, 3, 4, 5, 6], 3), ([1, 2, 3, 4], 2)], pad_id=0)
    b = collate_sft([([1, 9, 9, 4, 5, 6], 3), ([1, 8, 3, 4], 2)], pad_id=7)  # prompt/pad changed
    nll_a, _ = sft_nll_sum(model, a)
    nll_a.backward()
    grad = model.logits.grad.clone()
    nll_b, _ = sft_nll_sum(model, b)
    assert nll_a.item() == pytest.approx(nll_b.item())
    # logits[:, t] predicts token t+1: row 0 targets 1..2 are prompt, row 1 target 1 is prompt,
    # row 1 position 4..5 only predict padding; all of these get exactly zero gradient
    assert grad[0, :2].abs().sum() == 0 and grad[1, :1].abs().sum() == 0
    assert grad[1, 3:].abs().sum() == 0 and grad[0, 5].abs().sum() == 0
    assert grad[0, 2:5].abs().sum() > 0 and grad[1, 1:3].abs().sum() > 0
    # a changed completion target does change the loss
    c = collate_sft([([1, 2, 3, 4, 5, 9], 3), ([1, 2, 3, 4], 2)], pad_id=0)
    assert sft_nll_sum(model, c)[0].item() != pytest.approx(nll_a.item())


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
