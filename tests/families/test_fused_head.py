"""The fused chunked LM head covers every real family (issue 55, item 5): the same log-probs and
gradients as the full-logits path, and one line with their size where a model falls back."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from posttrain.engine import forward
from posttrain.engine.forward import completion_logprobs, fused_head_supported


def batch(vocab: int, n: int = 2, P: int = 5, T: int = 7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (n, P), generator=g)
    completion = torch.randint(0, vocab, (n, T), generator=g)
    pmask = torch.ones(n, P, dtype=torch.bool)
    pmask[0, :2] = False  # left padding
    cmask = torch.ones(n, T, dtype=torch.bool)
    cmask[1, 4:] = False  # right padding
    return prompt, pmask, completion, cmask


def logprobs_and_grads(model, inputs, fused: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    lp, _ = completion_logprobs(model, *inputs, fused=fused)
    (lp * inputs[3]).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


def test_fused_head_equals_full_logits(family, family_dir):
    model = AutoModelForCausalLM.from_pretrained(family_dir)
    assert fused_head_supported(model), forward.unfused_reason(model)
    inputs = batch(model.config.vocab_size)
    full, g_full = logprobs_and_grads(model, inputs, fused=False)
    fused, g_fused = logprobs_and_grads(model, inputs, fused=True)
    mask = inputs[3]
    torch.testing.assert_close(fused[mask], full[mask], rtol=1e-5, atol=1e-5)
    assert g_full.keys() == g_fused.keys()
    for name, g in g_full.items():
        torch.testing.assert_close(g_fused[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_softcapped_head_falls_back_with_one_line(family_builder, capsys, monkeypatch):
    """Gemma 3 with a final softcap (as Gemma 2 has) takes the full logits, said once."""
    model = AutoModelForCausalLM.from_pretrained(family_builder("gemma3"))
    model.config.final_logit_softcapping = 30.0
    assert not fused_head_supported(model)
    monkeypatch.setattr(forward, "_said_full", set())
    monkeypatch.setattr(forward, "FUSE_MIN_ELEMENTS", 1000)
    inputs = batch(model.config.vocab_size)
    with torch.no_grad():
        completion_logprobs(model, *inputs)
        completion_logprobs(model, *inputs)
    err = capsys.readouterr().err.splitlines()
    line = [x for x in err if "full logits" in x]
    assert line == ["posttrain: full logits: 2 x 7 x 262144 fp32 = 15 MB per micro-batch "
                    "(gemma3_text applies final_logit_softcapping=30.0 after the head, so the "
                    "fused chunked head is off; a smaller micro_batch_size or shorter "
                    "completions bound them)"], err
