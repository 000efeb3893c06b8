"""bf16_compute: the bf16 learner copy routes its gradients into the fp32 master weights."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.engine.forward import completion_logprobs
from posttrain.models.bf16_copy import BF16Copy
from posttrain.tasks.arithmetic import prompt_rows
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.ppo import PPOTrainer

COMMON = {"progress": False, "threads": 1, "report_to": [], "seed": 0}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny(tok, tie: bool = True):
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    if not tie:  # an untied head: its own weight
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def distinct_chars(completion: str) -> float:
    """A reward that differs between samples of an untrained model."""
    return float(len(set(completion)))


def batch(n: int = 6, P: int = 5, T: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 60, (n, P), generator=g)
    comp = torch.randint(3, 60, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.bool)
    mask[1, 4:] = False  # padding: counts nowhere
    return prompt, torch.ones(n, P, dtype=torch.bool), comp, mask


def loss_of(model, rows=slice(None)):
    p, pm, c, m = (x[rows] for x in batch())
    lp, _ = completion_logprobs(model, p, pm, c, m)  # [n, T]
    return -(lp * m).sum() / 40.0


@pytest.mark.parametrize("tie", [True, False])
def test_gradients_land_on_the_fp32_master_and_match_fp32(tok, tie):
    """After backward through the copy every trainable master parameter has an fp32 ``.grad``
    close to the one fp32 autograd gives (bf16 rounding: cosine > 0.99, 3% norm), the copy
    keeps no gradient, and the body is bf16 around the master's own fp32 head."""
    master = tiny(tok, tie)
    ref = tiny(tok, tie)
    learner = BF16Copy(master, trainable=True)
    head = learner.model.get_output_embeddings()
    assert head.weight is master.get_output_embeddings().weight
    assert learner.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    loss_of(learner.model).backward()
    loss_of(ref).backward()
    for (name, p), q in zip(master.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))
        assert abs(p.grad.norm() / q.grad.norm() - 1) < 0.03, name
    assert all(p.grad is None for p in learner.model.parameters()
               if p.dtype == torch.bfloat16)


def test_micro_batches_accumulate_in_fp32_like_one_batch(tok):
    """Two micro-batches (rows 0-2, 3-5) accumulate into the master's ``.grad`` what one
    batch of all six rows gives, to bf16 rounding of each part (the sum is taken in fp32)."""
    one, two = tiny(tok), tiny(tok)
    a, b = BF16Copy(one, trainable=True), BF16Copy(two, trainable=True)
    loss_of(a.model).backward()
    loss_of(b.model, slice(0, 3)).backward()
    loss_of(b.model, slice(3, 6)).backward()
    for (name, p), q in zip(one.named_parameters(), two.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-4, msg=name)


def test_sync_follows_the_master_and_masked_tokens_add_nothing(tok):
    """`sync` copies the updated master in (cast to bf16); a padded token's value does not
    change any gradient."""
    master = tiny(tok)
    learner = BF16Copy(master, trainable=True)
    with torch.no_grad():
        for p in master.parameters():
            p.add_(0.01)
    learner.sync()
    masters = dict(master.named_parameters(remove_duplicate=False))
    for name, p in learner.model.named_parameters():
        assert torch.equal(p, masters[name].detach().to(p.dtype)), name
    p, pm, c, m = batch()
    grads = []
    for fill in (5, 50):
        c2 = c.clone()
        c2[1, 4:] = fill  # masked positions
        master.zero_grad(set_to_none=True)
        lp, _ = completion_logprobs(learner.model, p, pm, c2, m)
        (-(lp * m).sum()).backward()
        grads.append([q.grad.clone() for q in master.parameters()])
    for g1, g2 in zip(*grads, strict=True):
        assert torch.equal(g1, g2)


def test_reference_copy_equals_the_learner_before_an_update(tok):
    """Built the same way from the same weights, the frozen reference copy gives the learner's
    log-probs bit for bit (so the KL starts at exactly 0), and takes no gradient."""
    learner = BF16Copy(tiny(tok), trainable=True)
    ref = BF16Copy(tiny(tok))
    assert not any(p.requires_grad for p in ref.model.parameters() if p.dtype == torch.bfloat16)
    p, pm, c, m = batch()
    lp, _ = completion_logprobs(learner.model, p, pm, c, m)
    with torch.no_grad():
        lr, _ = completion_logprobs(ref.model, p, pm, c, m)
    assert torch.equal(lp.detach(), lr)


def test_trainer_uses_the_copies_and_config_errors(tok, tmp_path):
    """GRPO under bf16_compute trains the fp32 master through a bf16 learner copy; trainers
    without support and LoRA runs get a config error naming the key before any model loads."""
    rows = [{"prompt": c, "answer": "7"} for c in "abcdefgh"]
    trainer = GRPOTrainer(model=tiny(tok), tokenizer=tok, train_data=rows, rewards=[distinct_chars],
                          out_dir=str(tmp_path / "g"), group_size=4, prompts_per_step=4,
                          max_new_tokens=8, kl_coef=0.1, bf16_compute=True, lr=1e-2, **COMMON)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step(1)
    learner = trainer.learner()
    assert learner is not trainer.model
    with trainer.reference() as ref:
        assert next(ref.model.parameters()).dtype == torch.bfloat16
    masters = dict(trainer.model.named_parameters(remove_duplicate=False))
    for name, p in learner.named_parameters():
        assert torch.equal(p, masters[name].detach().to(p.dtype)), name
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                      strict=True))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    with pytest.raises(ConfigError, match="bf16_compute"):
        PPOTrainer(model="__never_loaded__", tokenizer=tok, train_data=prompt_rows(4),
                   bf16_compute=True, out_dir=str(tmp_path / "p"), **COMMON)
    with pytest.raises(ConfigError, match="bf16_compute"):
        GRPOTrainer(model="__never_loaded__", tokenizer=tok, train_data=prompt_rows(4),
                    bf16_compute=True, lora_r=4, out_dir=str(tmp_path / "l"), **COMMON)


@pytest.mark.slow
def test_compiled_body_keeps_reference_learner_and_no_grad_passes_identical(tok):
    """torch_compile: the learner with grad, the learner under no_grad and the compiled frozen
    reference give bit-identical log-probs before an update (all run the differentiable
    graph); the values and master gradients match the uncompiled copy to bf16 rounding, and
    the reference receives no gradient."""
    learner = BF16Copy(tiny(tok), trainable=True, compile_body=True)
    ref = BF16Copy(tiny(tok), compile_body=True)
    plain_master = tiny(tok)
    plain = BF16Copy(plain_master, trainable=True)
    p, pm, c, m = batch()
    lp, _ = completion_logprobs(learner.model, p, pm, c, m)
    with torch.no_grad():
        lr, _ = completion_logprobs(ref.model, p, pm, c, m)
        ln, _ = completion_logprobs(learner.model, p, pm, c, m)
    assert not lr.requires_grad and not ln.requires_grad
    assert torch.equal(lp.detach(), lr) and torch.equal(lp.detach(), ln)
    lq, _ = completion_logprobs(plain.model, p, pm, c, m)
    torch.testing.assert_close(lp.detach(), lq.detach(), rtol=0.0, atol=0.05)
    (-(lp * m).sum()).backward()
    (-(lq * m).sum()).backward()
    masters = [q for _, q in learner._pairs]
    plains = [q for _, q in plain._pairs]
    for a, b in zip(masters, plains, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.grad.flatten(), b.grad.flatten(), dim=0)
        assert cos > 0.99, float(cos)
    assert all(q.grad is None for q in ref.model.parameters())


@pytest.mark.parametrize("tie", [True, False])
def test_fused_head_path_reads_the_fp32_master_head(tok, tie):
    """The fused chunked LM head (used at large vocabularies) through the copy: it sees the
    master's fp32 head weight, and log-probs and master gradients equal the unfused path's
    (float summation order)."""
    grads, lps = [], []
    for fused in (False, True):
        master = tiny(tok, tie)
        learner = BF16Copy(master, trainable=True)
        p, pm, c, m = batch()
        lp, _ = completion_logprobs(learner.model, p, pm, c, m, fused=fused)
        (-(lp * m).sum()).backward()
        lps.append(lp.detach())
        grads.append([q.grad.clone() for q in master.parameters()])
    torch.testing.assert_close(lps[0], lps[1], rtol=0.0, atol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_bf16_compute_with_fsdp_is_refused_on_the_cpu(tok, tmp_path):
    """FSDP2's bf16 mixed precision is CUDA only: on the CPU one line names both keys, before
    any model loads."""
    with pytest.raises(ConfigError, match="'bf16_compute' and 'fsdp'.*CUDA only"):
        GRPOTrainer(model="__never_loaded__", tokenizer=tok, train_data=prompt_rows(4),
                    bf16_compute=True, fsdp=True, device="cpu", out_dir=str(tmp_path / "f"),
                    **COMMON)


def test_compile_body_compiles_each_layer_and_keeps_the_reference_frozen(tok):
    """torch_compile: every decoder layer is compiled in place (lazily: nothing is traced
    here), the body's own forward is left alone, and the frozen reference copy's parameters
    do not require grad (its no-grad passes build no graph)."""
    from posttrain.models.bf16_copy import decoder_layers

    ref = BF16Copy(tiny(tok), compile_body=True)
    layers = decoder_layers(ref.model)
    assert len(layers) == 2 and all(layer._compiled_call_impl is not None for layer in layers)
    assert "forward" not in ref.model.base_model.__dict__
    assert not any(p.requires_grad for p, _ in ref._pairs)  # the body (the head is shared)
    learner = BF16Copy(tiny(tok), trainable=True, compile_body=True)
    assert all(p.requires_grad for p, _ in learner._pairs)
