"""`packing: true`: rows as one sequence give the padded forward's log-probs (fp32 within
1e-5) and gradients, fused head or not, sdpa or eager attention, on the tiny test models."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine.forward import completion_logprobs, fused_head_supported
from posttrain.models.packing import ROWS, pack, packed_attention, packing_problem
from posttrain.tasks.tiny import build_tiny_gemma2, build_tiny_llama, build_tiny_qwen2
from posttrain.tasks.tokenizer import build_char_tokenizer

BUILDERS = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2,
            "gemma2_sliding_softcap": lambda tok: build_tiny_gemma2(
                tok, final_logit_softcapping=2.0, sliding_window=8)}


def uneven_batch(vocab: int, n: int = 5, P: int = 7, T: int = 12, seed: int = 0
                 ) -> tuple[torch.Tensor, ...]:
    """n rows: prompts [n, P] left padded (1..P tokens), completions [n, T] right padded
    (1..T tokens, one row at T: a long tail beside short rows)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, P + 1, (n,), generator=g)
    c_len = torch.randint(1, T // 2, (n,), generator=g)
    c_len[0] = T
    p_ids = torch.randint(3, vocab, (n, P), generator=g)
    c_ids = torch.randint(3, vocab, (n, T), generator=g)
    p_mask = torch.arange(P).flip(0)[None] < p_len[:, None]  # left padded
    c_mask = torch.arange(T)[None] < c_len[:, None]  # right padded
    return p_ids * p_mask, p_mask.long(), c_ids * c_mask, c_mask.long()


# Gemma-2's softcapped attention runs eager only (transformers refuses sdpa for it)
SETUPS = [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager"),
          ("gemma2_sliding_softcap", "eager")]


@pytest.fixture(scope="module", params=SETUPS, ids=["-".join(s) for s in SETUPS])
def model(request):
    tok = build_char_tokenizer()
    model = BUILDERS[request.param[0]](tok).float().eval()
    model.set_attn_implementation(request.param[1])
    return model


def test_pack_golden():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    flat, pos, index = pack(ids, torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert flat.tolist() == [[5, 6, 7, 8, 9]] and pos.tolist() == [[0, 1, 0, 1, 2]]
    assert index.tolist() == [[-1, 0, 1], [2, 3, 4]]  # -1: a padded position (never read)


@pytest.mark.parametrize("fused", [False, True])
def test_packed_logprobs_and_gradients_equal_padded(model, fused):
    fused = fused and fused_head_supported(model)  # softcapped Gemma-2 has no fused head
    batch = uneven_batch(model.config.vocab_size)
    mask = batch[3].bool()
    assert packing_problem(model) is None
    out = {}
    for packing in (False, True):
        model.zero_grad(set_to_none=True)
        lp, _ = completion_logprobs(model, *batch, fused=fused, packing=packing)  # [n, T]
        torch.where(mask, lp, 0.0).sum().backward()
        out[packing] = lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None}
    (lp0, g0), (lp1, g1) = out[False], out[True]
    torch.testing.assert_close(lp1[mask], lp0[mask], atol=1e-5, rtol=0)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)


def test_which_attention_path_runs(model):
    """Full causal attention (Llama, Qwen2) runs sdpa per row inside a packed forward; Gemma-2
    (sliding windows, softcapping) keeps its kernel and transformers' packed-sequence mask."""
    before = model.config._attn_implementation
    with packed_attention(model):
        inside = model.config._attn_implementation
    assert model.config._attn_implementation == before
    assert inside == (before if model.config.model_type == "gemma2" else ROWS)


def test_a_model_that_mixes_rows_is_refused():
    """A model whose attention ignores the row boundaries (a mask builder that never sees
    packed position ids) is refused before its first packed forward, in one line."""
    tok = build_char_tokenizer()
    leaky = build_tiny_llama(tok).eval()
    body = leaky.model

    def forward(*a, position_ids=None, **k):  # noqa: ANN001, ANN202 - drops the boundaries
        return type(body).forward(body, *a, position_ids=None, **k)

    body.forward = forward
    problem = packing_problem(leaky)
    assert problem is not None and "attend to each other" in problem and "\n" not in problem
    with pytest.raises(ValueError, match="config key 'packing'"):
        completion_logprobs(leaky, *uneven_batch(leaky.config.vocab_size), packing=True)


def test_packed_critic_values_and_gradients_equal_padded(model):
    """PPO's critic (the policy's decoder + a value head) packed: the padded values and
    gradients (fp32 within 1e-5)."""
    from posttrain.models.value_head import critic_from_policy

    critic = critic_from_policy(model)
    batch = uneven_batch(model.config.vocab_size, seed=1)
    mask = batch[3].bool()
    out = []
    for packing in (False, True):
        critic.zero_grad(set_to_none=True)
        values = critic(*batch, packing=packing)  # [n, T]
        torch.where(mask, values, 0.0).square().sum().backward()
        out.append((values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()
                                      if p.grad is not None}))
    (v0, g0), (v1, g1) = out
    torch.testing.assert_close(v1[mask], v0[mask], atol=1e-5, rtol=0)
    assert (v1[~mask] == 0).all() and g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)
