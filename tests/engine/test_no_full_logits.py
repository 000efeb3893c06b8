"""No [N, T, V] fp32 tensor in a training step at a large vocabulary.

Every tensor produced by an aten op during one GRPO-style step (sampling, reference forward,
policy forward with entropy, backward) is recorded with a dispatch mode; no fp32 tensor with a
vocabulary-sized last dimension may hold more than one block of the fused head
(`posttrain.ops.fused_head`), far below N x T x V. The unfused path is the control: it does
allocate the full logits, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.engine.forward import PolicyForward, completion_logprobs
from posttrain.engine.trainer import enable_checkpointing
from posttrain.ops.fused_head import DEFAULT_BLOCK_ELEMENTS
from posttrain.rollout import SamplingParams
from posttrain.rollout.hf import sample_tokens

V, N, T = 65_536, 8, 64  # N * T * V = 33.6M floats (134 MB) per logits tensor


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest fp32 tensor (in elements) whose last dimension is V."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 2
                    and t.shape[-1] == V):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture(scope="module")
def big_vocab_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _step(model: torch.nn.Module, fused: bool | None, share: bool = False) -> None:
    """Sample N x T tokens, reference log-probs, policy forward + backward (`share`: each
    prompt once, its 2 completions on its cache)."""
    prompt_ids = torch.randint(3, V, (N // 2, 8))
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    model.eval()
    ids, mask, _, _ = sample_tokens(model, prompt_ids, prompt_mask,
                                    SamplingParams(max_new_tokens=T), eos_token_id=[1],
                                    pad_token_id=0, generator=torch.Generator().manual_seed(0),
                                    group_size=2)
    mask[:, :] = True  # count every position (EOS is improbable at this vocabulary anyway)
    p_ids, p_mask = prompt_ids.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0)
    ref = PolicyForward(share_prefix=share, fused=fused).batched(model, p_ids, p_mask, ids, mask,
                                                                 micro_batch_size=N)
    model.train()
    lp, ent = completion_logprobs(model, p_ids, p_mask, ids, mask, with_entropy=True,
                                  fused=fused, share_prefix=share)
    assert lp.shape == (N, T) and ent is not None
    ((lp - ref).exp() * mask).sum().backward()
    model.zero_grad()


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared_checkpointed"])
def test_no_full_fp32_logits_in_a_step(big_vocab_llama, share):
    """Also on the shared-prompt forward under activation checkpointing (the memory setting)."""
    if share:
        enable_checkpointing(big_vocab_llama)
    try:
        with _LargestVocabTensor() as rec:
            _step(big_vocab_llama, fused=None, share=share)
    finally:
        big_vocab_llama.gradient_checkpointing_disable()
    assert rec.largest <= DEFAULT_BLOCK_ELEMENTS < N * T * V // 3, rec.largest


def test_control_the_unfused_path_holds_full_logits(big_vocab_llama):
    with _LargestVocabTensor() as rec:
        _step(big_vocab_llama, fused=False)
    assert rec.largest >= N * T * V, rec.largest


def test_fused_equals_unfused(big_vocab_llama):
    model = big_vocab_llama.eval()
    g = torch.Generator().manual_seed(1)
    p_ids = torch.randint(3, V, (4, 6), generator=g)
    p_mask = torch.ones_like(p_ids, dtype=torch.bool)
    p_mask[0, :2] = False  # a left-padded prompt
    c_ids = torch.randint(3, V, (4, 10), generator=g)
    c_mask = torch.ones_like(c_ids, dtype=torch.bool)
    c_mask[1, 7:] = False
    for autocast in (False, True):
        a, ea = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.8,
                                    autocast=autocast, with_entropy=True, fused=True)
        b, eb = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.8,
                                    autocast=autocast, with_entropy=True, fused=False)
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-4)
