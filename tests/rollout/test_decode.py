"""The decode loop: log-probs match a full forward pass, shared-prefix prefill and finished-row
compaction change nothing, masks and truncation flags are right."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine.forward import completion_logprobs
from posttrain.rollout import SamplingParams, generate
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer


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


def _sampler_vs_learner(model, tok, params, generator=None, **kw):
    """Sample with `params`, recompute with the learner at the same temperature."""
    r = generate(model, tok, PROMPTS, group_size=4, params=params,
                 generator=generator or torch.Generator().manual_seed(0), **kw)
    lp, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                r.response_mask, temperature=params.temperature)
    return r, ((lp - r.logprobs) * r.response_mask).abs().max()


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=12, temperature=0.7),
    SamplingParams(max_new_tokens=12, temperature=1.6, top_k=5),
    SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.6),
    SamplingParams(max_new_tokens=12, temperature=1.3, top_k=20, top_p=0.9),
    SamplingParams(max_new_tokens=12, temperature=0.5, greedy=True),
], ids=["temp", "top_k", "top_p", "top_k_top_p", "greedy_temp"])
def test_sampler_logprobs_are_full_distribution_at_temperature(model_tok, params):
    """Log-probs are under the full (untruncated) distribution at the sampling temperature: the
    learner recomputes them exactly at the same temperature, and not at temperature 1."""
    model, tok = model_tok
    r, diff = _sampler_vs_learner(model, tok, params)
    assert diff < 1e-5, diff
    lp1, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                 r.response_mask, temperature=1.0)
    assert ((lp1 - r.logprobs) * r.response_mask).abs().max() > 1e-3  # the temperature matters


def test_top_k_keeps_only_the_k_best(model_tok):
    """With top_k=5 every sampled token is among the 5 most likely (checked by the learner)."""
    from posttrain.engine.forward import completion_logits

    model, tok = model_tok
    r = generate(model, tok, PROMPTS, group_size=4, generator=torch.Generator().manual_seed(1),
                 params=SamplingParams(max_new_tokens=12, temperature=2.0, top_k=5))
    logits = completion_logits(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                               r.response_mask)
    top5 = logits.topk(5, -1).indices  # [N, T, 5]
    T = logits.shape[1]
    inside = (top5 == r.completion_ids[:, :T, None]).any(-1)  # [N, T]
    assert inside[r.response_mask[:, :T]].all()


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=12, temperature=0.9, top_k=1),
    SamplingParams(max_new_tokens=12, temperature=0.9, top_p=1e-6),
], ids=["top_k_1", "top_p_tiny"])
def test_degenerate_truncation_equals_greedy(model_tok, params):
    model, tok = model_tok
    greedy = SamplingParams(max_new_tokens=12, temperature=0.9, greedy=True)
    g = generate(model, tok, PROMPTS, group_size=2, params=greedy)
    s = generate(model, tok, PROMPTS, group_size=2, params=params,
                 generator=torch.Generator().manual_seed(3))
    assert torch.equal(s.completion_ids, g.completion_ids)
    assert torch.equal(s.response_mask, g.response_mask)
    assert torch.allclose(s.logprobs, g.logprobs, atol=1e-6)


def test_stops_on_every_generation_config_eos_id():
    """A chat model ends its turn with a token that is not the tokenizer's EOS (Qwen2.5's
    <|im_end|>): generation_config.eos_token_id lists both, and sampling stops on either."""
    from posttrain.rollout import stop_token_ids

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=0).eval()
    im_end = tok.convert_tokens_to_ids("|")  # stands in for <|im_end|>
    model.generation_config.eos_token_id = [im_end, tok.eos_token_id]
    assert stop_token_ids(model, tok) == [im_end, tok.eos_token_id]
    with torch.no_grad():  # make the turn-end token likely
        head = model.get_output_embeddings().weight
        head[im_end] = head[im_end] * 0.0 + 0.3
    r = generate(model, tok, PROMPTS, group_size=4, generator=torch.Generator().manual_seed(0),
                 params=SamplingParams(max_new_tokens=40))
    lengths = r.response_mask.sum(1)
    last = r.completion_ids.gather(1, (lengths - 1)[:, None])[:, 0]
    assert (last[~r.truncated] == im_end).any()  # some rows ended their turn with <|im_end|>
    assert torch.isin(last[~r.truncated], torch.tensor([im_end, tok.eos_token_id])).all()
    counted = r.completion_ids.masked_fill(~r.response_mask, -1)
    n_stops = torch.isin(counted, torch.tensor([im_end, tok.eos_token_id])).sum(1)
    assert torch.equal(n_stops, (~r.truncated).long())  # exactly one stop, the last token
    # the tokenizer-only stop list (the old behaviour) samples on past <|im_end|>
    old = generate(model, tok, PROMPTS, group_size=4, stop_ids=[tok.eos_token_id],
                   generator=torch.Generator().manual_seed(0),
                   params=SamplingParams(max_new_tokens=40))
    old_counted = old.completion_ids.masked_fill(~old.response_mask, -1)
    assert ((old_counted == im_end).sum(1) > 1).any()


def test_lm_head_stays_fp32_under_bf16_autocast(model_tok):
    """Under autocast the sampler's and learner's logits come from an fp32 head, so they agree
    with the fp32 head applied to the same bf16 body output."""
    from posttrain.models.logits import head_outside_autocast

    model, tok = model_tok
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(input_ids=ids).logits.dtype == torch.bfloat16
        with head_outside_autocast(model):
            out = model(input_ids=ids)
            hidden = model.model(input_ids=ids).last_hidden_state
    assert out.logits.dtype == torch.float32
    want = model.get_output_embeddings()(hidden.float())
    assert torch.allclose(out.logits, want, atol=1e-6)
    assert "forward" not in model.get_output_embeddings().__dict__  # restored
    r, diff = _sampler_vs_learner(model, tok, SamplingParams(max_new_tokens=8), autocast=True)
    assert r.logprobs.dtype == torch.float32


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_generate_and_learner_on_device_with_cpu_generator(model_tok, device):
    """The trainer's CPU generator drives sampling on any device, reproducibly; the learner
    runs on the same device; DAPO-style concatenation keeps the device."""
    from posttrain.rollout import concat_rollouts

    model, tok = model_tok
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=0).to(device).eval()
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=30, top_p=0.95)
    a = generate(model, tok, PROMPTS, group_size=2, params=params,
                 generator=torch.Generator().manual_seed(7))
    b = generate(model, tok, PROMPTS, group_size=2, params=params,
                 generator=torch.Generator().manual_seed(7))
    assert a.completion_ids.device.type == device
    assert torch.equal(a.completion_ids, b.completion_ids)
    lp, _ = completion_logprobs(model, a.prompt_ids, a.prompt_mask, a.completion_ids,
                                a.response_mask, temperature=params.temperature)
    assert ((lp - a.logprobs) * a.response_mask).abs().max() < 1e-4
    greedy = generate(model, tok, PROMPTS[:1], params=SamplingParams(max_new_tokens=5,
                                                                      greedy=True))
    both = concat_rollouts([a, greedy], tok.pad_token_id)
    assert both.completion_ids.device.type == device and both.num_sequences == 7
    sub = both.select(torch.tensor([6, 0]))
    assert torch.equal(sub.completion_ids[1], a.completion_ids[0])
    if device != "cpu":
        bf = generate(model, tok, PROMPTS, group_size=2, params=params, autocast=True,
                      generator=torch.Generator().manual_seed(7))
        assert bf.logprobs.device.type == device


@pytest.mark.parametrize("every", [3, 8, 1000])
def test_sync_cadence_changes_no_sample(model_tok, monkeypatch, every):
    """The accelerator's cadence (finished rows counted every 8 steps, here also 3 and never)
    run on the CPU gives the tokens, masks and truncation flags of the every-step cadence;
    log-probs agree to float rounding (compaction changes the batch a row runs in). The
    per-row seeds make each row's draws independent of the batch."""
    from posttrain.rollout import hf

    model, tok = model_tok
    kw = {"group_size": 4, "params": SamplingParams(max_new_tokens=16), "seeds": list(range(12))}
    want = generate(model, tok, PROMPTS, **kw)
    lengths = want.response_mask.sum(1)
    assert lengths.min() < lengths.max() and want.truncated.any() and not want.truncated.all()
    monkeypatch.setattr(hf, "sync_every", lambda device: every)
    got = generate(model, tok, PROMPTS, **kw)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert torch.equal(got.truncated, want.truncated)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0.0, atol=1e-5)


def test_masks_end_at_the_first_stop_id():
    """`_finish`: each row's mask runs through its first stop id (any of several), later
    tokens are padding, a row without one is truncated; columns no row uses are cut.
    Rows: [5, 2, 7, 2] stops at 1; [3, 4, 9, 1] stops at 2 (id 9); [3, 3, 3, 3] runs to the
    end; so the widest row uses all 4 columns."""
    from posttrain.rollout.hf import _finish

    tokens = torch.tensor([[5, 2, 7, 2], [3, 4, 9, 1], [3, 3, 3, 3]])
    lp = -torch.arange(1.0, 13.0).view(3, 4)
    ids, mask, logp, truncated = _finish(tokens, lp, torch.tensor([2, 9]), pad_token_id=0)
    assert mask.tolist() == [[True, True, False, False], [True, True, True, False],
                             [True] * 4]
    assert ids.tolist() == [[5, 2, 0, 0], [3, 4, 9, 0], [3, 3, 3, 3]]
    assert logp[0].tolist() == [-1.0, -2.0, 0.0, 0.0]
    assert truncated.tolist() == [False, False, True]
    short = _finish(tokens[:2, :3], lp[:2, :3], torch.tensor([2, 9]), pad_token_id=0)
    assert short[0].shape == (2, 3)
    cut = _finish(torch.tensor([[2, 5, 5]]), lp[:1, :3], torch.tensor([2]), pad_token_id=0)
    assert cut[0].tolist() == [[2]] and cut[1].tolist() == [[True]]
    # own limits [1, 4, 2]: row 0 stops after 1 token (its stop id at 1 is past it: truncated),
    # row 1 as before, row 2 after 2 tokens (truncated); the widest row uses 3 columns
    ids, mask, logp, truncated = _finish(tokens, lp, torch.tensor([2, 9]), 0,
                                         torch.tensor([1, 4, 2]))
    assert mask.tolist() == [[True, False, False], [True, True, True], [True, True, False]]
    assert ids.tolist() == [[5, 0, 0], [3, 4, 9], [3, 3, 0]]
    assert logp[2].tolist() == [-9.0, -10.0, 0.0]
    assert truncated.tolist() == [True, False, True]


def test_ready_4d_step_mask_changes_no_sample(model_tok, monkeypatch):
    """The accelerator's decode steps (a ready [n, 1, 1, L] sdpa mask, counts every 8 steps)
    run on the CPU: same tokens and masks as the CPU's own path, with left-padded prompts of
    different lengths (the mask matters) and rows finishing at different steps."""
    from posttrain.rollout import hf

    model, tok = model_tok
    assert model.config._attn_implementation == "sdpa"
    assert not hf.step_mask_4d(model, "cpu") and hf.step_mask_4d(model, "cuda")
    kw = {"group_size": 3, "params": SamplingParams(max_new_tokens=14),
          "seeds": list(range(50, 59))}
    want = generate(model, tok, PROMPTS, **kw)
    calls = []
    real = hf.step_mask_4d
    monkeypatch.setattr(hf, "sync_every", lambda device: 8)
    monkeypatch.setattr(hf, "step_mask_4d", lambda m, d: calls.append(real(m, "cuda")) or True)
    got = generate(model, tok, PROMPTS, **kw)
    assert calls == [True]
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0.0, atol=1e-5)


def test_ready_4d_step_mask_only_for_full_sdpa_attention(model_tok):
    from posttrain.rollout.hf import step_mask_4d

    model, tok = model_tok
    cfg = model.config
    try:
        cfg.sliding_window = 16
        assert not step_mask_4d(model, "cuda")
        cfg.use_sliding_window = False  # Qwen2's switch: the window is off
        assert step_mask_4d(model, "cuda")
        cfg.layer_types = ["full_attention", "sliding_attention"]
        assert not step_mask_4d(model, "cuda")
    finally:
        for key in ("sliding_window", "use_sliding_window", "layer_types"):
            cfg.__dict__.pop(key, None)
    assert step_mask_4d(model, "cuda")
