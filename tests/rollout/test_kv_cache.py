"""The in-place decode cache: same tensors as transformers' growing cache, same samples."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import posttrain.rollout.hf as hf
from posttrain.rollout import SamplingParams, generate
from posttrain.rollout.kv_cache import PreallocatedLayer, decode_cache
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


def test_decode_cache_replaces_only_full_attention_layers():
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=3, num_heads=2,
                             intermediate_size=32, seed=0)
    cache = decode_cache(model, 20)
    assert [type(layer) for layer in cache.layers] == [PreallocatedLayer] * 3
    assert all(layer.capacity == 20 for layer in cache.layers)


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
