"""The in-place decode cache: same tensors as transformers' growing cache, same samples."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import posttrain.rollout.hf as hf
from posttrain.rollout import SamplingParams, generate
from posttrain.rollout.kv_cache import PreallocatedLayer, can_carry, decode_cache
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer


def test_layer_matches_dynamic_layer_through_repeat_select_and_updates():
    gen = torch.Generator().manual_seed(0)
    ours, ref = PreallocatedLayer(capacity=9), DynamicLayer()

    def kv(b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(b, 2, length, 4, generator=gen),
                torch.randn(b, 2, length, 3, generator=gen))

    steps = [("update", kv(2, 4)), ("repeat", 3), ("update", kv(6, 1)),
             ("select", torch.tensor([0, 2, 5])), ("update", kv(3, 1)), ("update", kv(3, 2))]
    for op, arg in steps:
        if op == "update":
            k1, v1 = ours.update(*arg)
            k2, v2 = ref.update(*arg)
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        elif op == "repeat":
            ours.batch_repeat_interleave(arg)
            ref.batch_repeat_interleave(arg)
        else:
            ours.batch_select_indices(arg)
            ref.batch_select_indices(arg)
        assert ours.get_seq_length() == ref.get_seq_length()
        assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
    assert ours.get_seq_length() == 8
    with pytest.raises(RuntimeError, match="capacity 9"):
        ours.update(*kv(3, 2))


def test_layer_of_another_dtype_keeps_the_upcast_states():
    """A layer with a dtype (the bf16 sampler copy's fp32 cache) holds every written state
    exactly, upcast, through repeat and select; a model's ``kv_cache_dtype`` reaches it."""
    gen = torch.Generator().manual_seed(0)
    ours, ref = PreallocatedLayer(capacity=6, dtype=torch.float32), DynamicLayer()
    k, v = (torch.randn(2, 2, 3, 4, generator=gen).bfloat16() for _ in range(2))
    k1, _ = ours.update(k, v)
    ref.update(k, v)
    ours.batch_repeat_interleave(2)
    ref.batch_repeat_interleave(2)
    k2, v2 = (torch.randn(4, 2, 1, 4, generator=gen).bfloat16() for _ in range(2))
    keys, values = ours.update(k2, v2)
    want_k, want_v = ref.update(k2, v2)
    assert k1.dtype == keys.dtype == torch.float32
    assert torch.equal(keys, want_k.float()) and torch.equal(values, want_v.float())
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32)
    assert decode_cache(model, 4).layers[0].dtype is None
    model.kv_cache_dtype = torch.float32
    assert decode_cache(model, 4).layers[0].dtype is torch.float32


def test_decode_cache_replaces_only_full_attention_layers():
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=3, num_heads=2,
                             intermediate_size=32, seed=0)
    cache = decode_cache(model, 20)
    assert [type(layer) for layer in cache.layers] == [PreallocatedLayer] * 3
    assert all(layer.capacity == 20 for layer in cache.layers) and can_carry(cache)


def test_samples_equal_the_growing_cache(monkeypatch):
    """Same seeds -> the same tokens and log-probs as with transformers' DynamicCache, with
    rows finishing early (compaction) and G samples sharing a prefill."""
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=0).eval()
    with torch.no_grad():  # EOS likely: rows end at different steps
        model.get_output_embeddings().weight[tok.eos_token_id] = 0.3
    prompts = ["12+7\n", "3*4-1\n", "5\n"]
    params = SamplingParams(max_new_tokens=14)

    def run():
        return generate(model, tok, prompts, group_size=4, params=params,
                        seeds=list(range(12)))

    ours = run()
    monkeypatch.setattr(hf, "decode_cache", lambda m, cap: DynamicCache(config=m.config))
    ref = run()
    lengths = ref.response_mask.sum(1)
    assert lengths.min() < lengths.max()  # compaction ran
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    assert torch.equal(ours.response_mask, ref.response_mask)
    assert torch.allclose(ours.logprobs, ref.logprobs, atol=1e-6, rtol=0)


def _left_padded(contexts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.bool)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):], mask[i, width - len(c):] = torch.tensor(c), True
    return ids, mask


@pytest.mark.parametrize("every", [1, 8])
def test_turns_on_the_carried_cache_equal_reprefilling_the_whole_context(monkeypatch, every):
    """Three turns of 6 sequences, each continued on the cache of the last turn (only the
    tokens appended since are prefilled, finished sequences freed, rows parked within a turn
    as they stop): the same ids as `sample_tokens` on the whole left-padded contexts with the
    same uniforms (what each turn ran before), log-probs to float rounding; every sequence
    stops at its own limit. every=8: the accelerator's loop (finished rows run on up to 7
    steps before they leave, the 4-D step mask)."""
    monkeypatch.setattr(hf, "sync_every", lambda device: every)
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=1).eval()
    with torch.no_grad():  # EOS likely: turns end at different steps
        model.get_output_embeddings().weight[tok.eos_token_id] = 0.8
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ctx = {k: tok(p, add_special_tokens=False)["input_ids"]
           for k, p in enumerate(["12+7\n", "3*4-1\n", "5\n", "abc\n", "99*99=\n", "x\n"])}
    assert hf.step_mask_4d(model, "cpu") == (every == 8)
    params, carried, freed, cut, parked = SamplingParams(max_new_tokens=0), None, 0, 0, 0
    for turn in range(3):
        keys = sorted(ctx)
        limits = [6 + (5 * k + turn) % 11 for k in keys]  # [6, 16]: each its own budget
        u = hf.sequence_uniforms([100 * turn + k for k in keys], max(limits))  # [n, T]
        toks, mask, lps, trunc, carried = hf.sample_turn(
            model, [ctx[k] for k in keys], keys, limits, params, eos, pad, uniforms=u,
            carried=carried)
        ids, pm = _left_padded([ctx[k] for k in keys], pad)
        ref = hf.sample_tokens(model, ids, pm, SamplingParams(max_new_tokens=max(limits)),
                               eos, pad, uniforms=u)
        for i, k in enumerate(keys):
            n = int(mask[i].sum())
            want = min(int(ref[1][i].sum()), limits[i])  # the reference ran past the limit
            assert n == want and bool(trunc[i]) == (toks[i, n - 1] != eos)
            assert toks[i, :n].tolist() == ref[0][i, :n].tolist()
            assert torch.allclose(lps[i, :n], ref[2][i, :n], atol=1e-5, rtol=0)
            ctx[k] = ctx[k] + toks[i, :n].tolist()
            cut += bool(trunc[i])
            if bool(trunc[i]) or k == turn:  # cut at its budget, or done: its row is freed
                del ctx[k]
                freed += 1
            else:  # a tool answer of its own length after the stop id
                ctx[k] += tok(f"<tool_response>{7 ** (k + turn)}</tool_response>\n",
                              add_special_tokens=False)["input_ids"]
        assert carried is not None and sum(len(b[0]) for b in carried) == len(keys)
        parked += len(carried) > 1  # rows left the batch within the turn (parked)
    assert freed >= 3 and 0 < cut and parked >= 1


def test_a_sliding_window_cache_is_not_carried():
    """Sliding-window layers (`can_carry` False): every turn prefills the whole contexts, no
    cache is handed on, and the samples are `sample_tokens`' with each row cut at its limit."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=32, sliding_window=4)).eval()
    assert not can_carry(decode_cache(model, 8))
    contexts, limits = [[5, 6, 7, 8, 9, 10], [11, 12]], [6, 3]
    u = hf.sequence_uniforms([1, 2], 6)
    toks, mask, lps, trunc, carried = hf.sample_turn(
        model, contexts, [0, 1], limits, SamplingParams(), 0, 1, uniforms=u)
    ref = hf.sample_tokens(model, *_left_padded(contexts, 1), SamplingParams(max_new_tokens=6),
                           0, 1, uniforms=u)
    assert carried is None and mask.sum(1).tolist() == [6, 3]  # no stop id: cut at the limit
    assert toks[1, :3].tolist() == ref[0][1, :3].tolist() and bool(trunc.all())
    assert torch.equal(toks[0], ref[0][0]) and torch.allclose(lps[0], ref[2][0], atol=1e-6)
