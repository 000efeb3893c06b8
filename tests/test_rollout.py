"""The decode loop: log-probs match a full forward pass, shared-prefix prefill and finished-row
compaction change nothing, masks and truncation flags are right."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import build_char_tokenizer, build_tiny_llama
from posttrain.rollout import SamplingParams, generate
from posttrain.trainers.forward import completion_logprobs


@pytest.fixture(scope="module")
def model_tok():
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=0)
    # make EOS likely so that rows finish at different times (exercises compaction)
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= 0.0
        model.get_output_embeddings().weight[tok.eos_token_id] += 0.3
    return model.eval(), tok


PROMPTS = ["12+7\n", "3*4-1\n", "5\n"]


def test_sampling_logprobs_match_full_forward(model_tok):
    model, tok = model_tok
    r = generate(model, tok, PROMPTS, group_size=4, params=SamplingParams(max_new_tokens=12),
                 generator=torch.Generator().manual_seed(0))
    assert r.completion_ids.shape[0] == 12 and r.response_mask.any(1).all()
    lengths = r.response_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows finished at different steps
    lp, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                r.response_mask)
    diff = ((lp - r.logprobs) * r.response_mask).abs().max()
    assert diff < 1e-4, diff
    assert torch.equal(r.logprobs * ~r.response_mask, torch.zeros_like(r.logprobs))
    # truncated <=> no EOS inside the mask
    has_eos = ((r.completion_ids == tok.eos_token_id) & r.response_mask).any(1)
    assert torch.equal(r.truncated, ~has_eos)


def test_group_prefill_equals_repeated_prompts(model_tok):
    """G samples per prompt with a shared prefill == the prompts repeated G times (greedy)."""
    model, tok = model_tok
    params = SamplingParams(max_new_tokens=10, greedy=True)
    grouped = generate(model, tok, PROMPTS, group_size=3, params=params)
    repeated = generate(model, tok, [p for p in PROMPTS for _ in range(3)], params=params)
    assert grouped.completions == repeated.completions
    assert torch.allclose(grouped.logprobs, repeated.logprobs, atol=1e-5)


def test_batched_equals_one_at_a_time(model_tok):
    model, tok = model_tok
    params = SamplingParams(max_new_tokens=10, greedy=True)
    batched = generate(model, tok, PROMPTS, params=params)
    single = [generate(model, tok, [p], params=params).completions[0] for p in PROMPTS]
    assert batched.completions == single
    split = generate(model, tok, PROMPTS, params=params, batch_size=1)
    assert split.completions == single
