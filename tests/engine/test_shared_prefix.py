"""Shared-prefix forward: each distinct prompt runs once, its completions on its KV cache. Same
log-probs and same gradients as the plain forward over every (prompt, completion) row."""

from __future__ import annotations

import weakref

import pytest
import torch
import transformers as tf
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.engine import shared_prefix
from posttrain.engine.forward import PolicyForward, completion_logprobs
from posttrain.engine.shared_prefix import (
    length_buckets,
    prefix_groups,
    shared_prefix_outputs,
    shared_prefix_supported,
)
from posttrain.engine.trainer import enable_checkpointing

V = 48
SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE)),  # q/k/v biases
    # the input embedding is the LM head: its lookup gradient is scattered in place by a hook,
    # once per forward call (the prefix pass and every length group)
    "qwen2_tied": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    # a sliding window shorter than prompt + completion: the mask applies it in both paths
    "mistral_window4": lambda: tf.MistralForCausalLM(tf.MistralConfig(**SHAPE, sliding_window=4)),
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    with torch.no_grad():  # logits of a few units, so differences would show
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def _batch(shuffle: bool = True) -> tuple[torch.Tensor, ...]:
    """3 distinct left-padded prompts (lengths 6, 3, 5) x 3 completions each, rows shuffled,
    right-padded completions of lengths 1..7; padding holds junk tokens (it must not matter)."""
    g = torch.Generator().manual_seed(0)
    lengths, P, T = [6, 3, 5], 6, 7
    p_ids = torch.randint(3, V, (3, P), generator=g)
    p_mask = torch.zeros(3, P, dtype=torch.bool)
    for i, n in enumerate(lengths):
        p_mask[i, P - n:] = True
    rows = torch.arange(9) // 3  # [9]: each prompt 3 times
    if shuffle:
        rows = rows[torch.randperm(9, generator=g)]
    c_ids = torch.randint(3, V, (9, T), generator=g)
    c_len = torch.tensor([7, 1, 4, 6, 7, 2, 5, 3, 7])
    c_mask = torch.arange(T)[None] < c_len[:, None]  # [9, T]
    return p_ids[rows], p_mask[rows], c_ids, c_mask


def test_prefix_groups_finds_each_distinct_prompt_once():
    p_ids, p_mask, _, _ = _batch()
    first, inverse = prefix_groups(p_ids, p_mask)
    assert first.shape == (3,) and inverse.shape == (9,)
    assert torch.equal(p_ids[first][inverse], p_ids) and torch.equal(p_mask[first][inverse], p_mask)
    assert torch.equal(first[inverse][first], first)  # each prompt's representative is itself
    # same tokens under a different padding are different prompts
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [5, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    first, inverse = prefix_groups(ids, mask)
    assert first.numel() == 3 and inverse.unique().numel() == 3


def test_length_buckets_golden():
    """Sorted lengths 1,2,3,4,5,6,7,7,7 (one group: 9 x 7 = 63 positions). Splits keeping 4+
    rows a side: after 4 rows saves 4 x (7 - 4) = 12, after 5 saves 5 x (7 - 5) = 10: split
    after 4 -> 4 x 4 + 5 x 7 = 51 positions; no group of 4-5 rows can split again."""
    lengths = torch.tensor([7, 1, 4, 6, 7, 2, 5, 3, 7])
    groups = length_buckets(lengths)
    assert [sorted(lengths[g].tolist()) for g in groups] == [[1, 2, 3, 4], [5, 6, 7, 7, 7]]
    assert sorted(torch.cat(groups).tolist()) == list(range(9))
    assert len(length_buckets(lengths, max_buckets=1)) == 1
    assert len(length_buckets(lengths, min_rows=5)) == 1  # 4 + 5 rows is the only split
    # groups of 2+ rows, greedy, largest saving first: after 4 (12), then after 2 within
    # 1..4 (2 x (4 - 2) = 4); after 6 within 5..7 would save 2 x (7 - 6) = 2 < 5% of 63 = 3.15
    two = [sorted(lengths[g].tolist()) for g in length_buckets(lengths, min_rows=2)]
    assert two == [[1, 2], [3, 4], [5, 6, 7, 7, 7]]
    assert len(length_buckets(torch.full((16,), 5))) == 1  # equal lengths: nothing to save


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("buckets", [1, 4], ids=["one_group", "length_groups"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_same_logprobs_and_gradients_as_the_plain_forward(family, fused, buckets, ckpt,
                                                          monkeypatch):
    """Also with non-reentrant activation checkpointing, where the cache goes through the
    checkpointed layers and each layer's backward replays it (`OneCallLayer`); the plain
    reference runs without checkpointing."""
    monkeypatch.setattr(shared_prefix, "MAX_BUCKETS", buckets)
    model = _model(family).train()  # dropout is 0 in these configs
    p_ids, p_mask, c_ids, c_mask = _batch()
    grads = []
    for share in (False, True):
        if share and ckpt:
            enable_checkpointing(model)
            assert shared_prefix_supported(model)
        model.zero_grad()
        lp, ent = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.8,
                                      with_entropy=True, fused=fused, share_prefix=share)
        (lp * c_mask * torch.linspace(0.5, 1.5, 7)).sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        if not share:
            want_lp, want_ent = lp.detach(), ent
    assert (lp.detach() - want_lp)[c_mask].abs().max() < 1e-5
    assert (ent - want_ent)[c_mask].abs().max() < 1e-5
    assert want_lp[c_mask].std() > 0.3  # log-probs that vary: a wrong position would show
    for k, g in grads[0].items():  # equal up to float summation order
        assert g.abs().max() > 0, k
        assert (grads[1][k] - g).abs().max() <= 1e-5 * g.abs().max(), k


def test_rows_split_over_two_ranks_match_one_micro_batch():
    """1 rank == 2 ranks at the forward: the 9 rows in one micro-batch (3 prompts, 2 length
    groups) or split as two ranks would get them (one row of each prompt: nothing shared, the
    plain forward; the other 6: each prompt's rows on both sides) give the same log-probs and,
    summed, the same gradient, up to float summation order. Which rows share a micro-batch
    changes only the rounding (docs/distributed.md: a step whose exact gradient is 0 shows
    it). A prompt's 3 rows hold one completion, as a deterministic model writes them."""
    model = _model("llama").train()
    p_ids, p_mask, c_ids, c_mask = _batch()
    prompt = prefix_groups(p_ids, p_mask)[1]  # [9] each row's prompt
    same = (prompt == 0).nonzero()[:, 0]  # [3]
    c_ids[same], c_mask[same] = c_ids[same[0]].clone(), c_mask[same[0]].clone()
    lone = torch.stack([(prompt == k).nonzero()[0, 0] for k in range(3)])  # [3]
    rest = torch.tensor([i for i in range(9) if i not in lone.tolist()])  # [6]
    with torch.no_grad():
        assert shared_prefix_outputs(model, p_ids[lone], p_mask[lone], c_ids[lone],
                                     c_mask[lone]) is None
    runs = []
    for parts in ([torch.arange(9)], [lone, rest]):
        model.zero_grad()
        lp = torch.zeros(9, 7)
        for idx in parts:
            out, _ = completion_logprobs(model, p_ids[idx], p_mask[idx], c_ids[idx],
                                         c_mask[idx], share_prefix=True)
            (out * c_mask[idx] * torch.linspace(0.5, 1.5, 7)).sum().backward()
            lp[idx] = out.detach()
        runs.append((lp, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (lp1, g1), (lp2, g2) = runs
    assert (lp2 - lp1)[c_mask].abs().max() < 1e-5 and lp1[c_mask].std() > 0.3
    for k, g in g1.items():
        assert g.abs().max() > 0 and (g2[k] - g).abs().max() <= 1e-5 * g.abs().max(), k


@pytest.mark.parametrize(("buckets", "passes"), [(1, 81), (4, 69)])
def test_the_prompt_is_embedded_once_per_distinct_prompt(buckets, passes, monkeypatch):
    """3 prompts of 6 columns + 9 completions of 7: 3 x 6 + 9 x 7 = 81 token passes, against
    9 x (6 + 7) = 117 for the plain forward; in two length groups (`test_length_buckets_golden`)
    the completions take 4 x 4 + 5 x 7 = 51: 18 + 51 = 69."""
    monkeypatch.setattr(shared_prefix, "MAX_BUCKETS", buckets)
    model = _model("llama").eval()
    p_ids, p_mask, c_ids, c_mask = _batch()
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, inp, _o: seen.append(inp[0].numel()))
    with torch.no_grad():
        for share in (False, True):
            seen.clear()
            completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, share_prefix=share)
            assert sum(seen) == (passes if share else 117)
    hook.remove()


def test_distinct_prompts_still_run_in_length_groups():
    """Every row its own prompt (PPO with group_size 1): nothing to share, but the completions
    (lengths 1-7) still run in two length groups, with the plain forward's log-probs and
    gradients; one length group left -> the plain forward (None)."""
    model = _model("llama").train()
    _, _, c_ids, c_mask = _batch()
    g = torch.Generator().manual_seed(3)
    p_ids, p_mask = torch.randint(3, V, (9, 5), generator=g), torch.ones(9, 5, dtype=torch.bool)
    with torch.no_grad():
        assert shared_prefix_outputs(model, p_ids, p_mask, c_ids, c_mask) is not None
        same = torch.ones_like(c_mask)  # all of length 7: one group
        assert shared_prefix_outputs(model, p_ids, p_mask, c_ids, same) is None
    lps, grads = [], []
    for share in (False, True):
        model.zero_grad()
        lp, _ = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, share_prefix=share)
        (lp * c_mask).sum().backward()
        lps.append(lp.detach())
        grads.append(model.model.layers[0].mlp.down_proj.weight.grad.clone())
    assert (lps[1] - lps[0])[c_mask].abs().max() < 1e-5
    assert (grads[1] - grads[0]).abs().max() <= 1e-5 * grads[0].abs().max()


def test_checkpointed_layers_replay_the_shared_cache(monkeypatch):
    """Under checkpointing each decoder layer runs again in the backward (its MLP's forward is
    called for the prefix pass + 2 length groups = 2 layers x 3 times, twice that with the
    replays; module hooks do not fire in a replay, so the forward itself is counted), and the
    replay neither grows the cache nor loses the prompt (same gradients as without)."""
    model = _model("llama").train()
    p_ids, p_mask, c_ids, c_mask = _batch()
    mlp_class = type(model.model.layers[0].mlp)
    calls, forward = [], mlp_class.forward
    monkeypatch.setattr(mlp_class, "forward", lambda m, x: calls.append(1) or forward(m, x))
    grads = []
    for ckpt in (False, True):
        if ckpt:
            enable_checkpointing(model)
        model.zero_grad()
        calls.clear()
        lp, _ = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, share_prefix=True)
        (lp * c_mask).sum().backward()
        assert len(calls) == (12 if ckpt else 6)
        # the keep-the-cache switch is only on during the forward calls
        assert not any(m.__dict__.get("_can_checkpoint_with_cache") for m in model.modules())
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        assert (g1 - g0).abs().max() <= 1e-6 * g0.abs().max()


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that aten ops created and that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                self.live[storage.data_ptr()] = storage.nbytes()
                weakref.finalize(storage, self.live.pop, storage.data_ptr(), None)
        return out


def test_checkpointed_shared_forward_holds_less_than_the_plain_one():
    """Between forward and backward a checkpointed forward keeps each layer's input; the shared
    one must not keep per-row copies of the prompt's keys/values (nor the concatenated ones) on
    top: 4 prompts of 48 tokens x 4 completions of 8, it holds less than the plain forward
    (measured: 0.38 MiB against 0.64 MiB; 0.79 MiB when the per-row copies and the
    concatenated keys/values were held)."""
    model = _model("llama").train()
    enable_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    p_ids = torch.randint(3, V, (4, 48), generator=g).repeat_interleave(4, 0)  # [16, 48]
    p_mask = torch.ones_like(p_ids, dtype=torch.bool)
    c_ids = torch.randint(3, V, (16, 8), generator=g)
    c_mask = torch.ones_like(c_ids, dtype=torch.bool)
    held = {}
    for share in (False, True):
        with _LiveBytes() as rec:
            lp, _ = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, share_prefix=share)
            held[share] = sum(rec.live.values())
        lp.sum().backward()  # the replays run after the mode is gone
    assert held[True] < 0.75 * held[False], held


def test_batched_no_grad_logprobs_match():
    model = _model("qwen2").eval()
    p_ids, p_mask, c_ids, c_mask = _batch()
    plain = PolicyForward().batched(model, p_ids, p_mask, c_ids, c_mask, micro_batch_size=4)
    shared = PolicyForward(share_prefix=True).batched(model, p_ids, p_mask, c_ids, c_mask,
                                                      micro_batch_size=4)
    assert (plain - shared)[c_mask].abs().max() < 1e-5


def test_nothing_to_share_or_unsupported_runs_the_plain_forward():
    model = _model("llama").eval()
    p_ids, p_mask, c_ids, c_mask = _batch(shuffle=False)
    firsts = torch.tensor([0, 3, 6])  # one row of each prompt, too few rows to split by length
    with torch.no_grad():
        assert shared_prefix_outputs(model, p_ids[firsts], p_mask[firsts], c_ids[firsts],
                                     c_mask[firsts]) is None
    assert shared_prefix_supported(model)
    # reentrant checkpointing replays a layer from its arguments only: the prompt's keys/values
    # in the cache would get no gradient, so the plain forward runs
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    assert not shared_prefix_supported(model)
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda _m, i, _o: seen.append(i[0].numel()))
    completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, share_prefix=True)
    assert sum(seen) == 117  # 9 rows x (6 + 7): the plain forward ran
    dropped = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, attention_dropout=0.1))
    assert shared_prefix_supported(dropped.eval()) and not shared_prefix_supported(dropped.train())
    torch.manual_seed(0)
    gpt2 = torch.nn.Module()
    gpt2.config = type("C", (), {"model_type": "gpt2"})()
    assert not shared_prefix_supported(gpt2)
