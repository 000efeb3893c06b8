"""The bf16 sampler copy: bf16 body, the policy's fp32 head, weights equal the policy's after
every optimizer step."""

from __future__ import annotations

import torch

from posttrain.engine.forward import completion_logprobs
from posttrain.models.bf16_copy import BF16SamplingCopy, bf16_copy_supported
from posttrain.rollout import SamplingParams, generate
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer


def _tiny():
    tok = build_char_tokenizer()
    return build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                            intermediate_size=64, seed=0), tok


def _assert_synced(sampler: BF16SamplingCopy, policy: torch.nn.Module) -> None:
    head = policy.get_output_embeddings().weight
    masters = dict(policy.named_parameters(remove_duplicate=False))
    for name, mine in sampler.model.named_parameters():
        if mine is head:  # the copy runs the policy's own fp32 head
            continue
        assert mine.dtype == torch.bfloat16, name
        assert torch.equal(mine, masters[name].detach().to(torch.bfloat16)), name
    assert sampler.model.get_output_embeddings().weight is head


def test_copy_is_bf16_with_the_policys_fp32_head():
    policy, _ = _tiny()
    sampler = BF16SamplingCopy(policy)
    _assert_synced(sampler, policy)
    for (name, buf), ref in zip(sampler.model.named_buffers(), policy.buffers(), strict=True):
        assert buf.dtype == ref.dtype, name  # rotary inv_freq stays fp32
    head = policy.get_output_embeddings().weight  # shared with the policy: its own flag
    assert not any(p.requires_grad for p in sampler.model.parameters() if p is not head)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        hidden = sampler.model.model(input_ids=ids).last_hidden_state  # [1, 5, H] bf16
        logits = sampler.model(input_ids=ids).logits
        want = policy.get_output_embeddings()(hidden.float())
        full = policy(input_ids=ids).logits
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, want)  # the head is the policy's fp32 head
    assert (logits - full).abs().max() < 0.05  # bf16 body ~ fp32 body


def test_sync_follows_an_optimizer_step():
    policy, _ = _tiny()
    sampler = BF16SamplingCopy(policy)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    policy(input_ids=torch.tensor([[5, 6, 7]])).logits.square().mean().backward()
    opt.step()
    stale = sampler.model.model.layers[0].mlp.up_proj.weight.float()
    assert not torch.equal(stale, policy.model.layers[0].mlp.up_proj.weight.bfloat16().float())
    sampler.sync()
    _assert_synced(sampler, policy)


def test_samples_score_like_the_policy():
    """Rollout log-probs from the copy are the policy's up to bf16 body rounding."""
    policy, tok = _tiny()
    sampler = BF16SamplingCopy(policy)
    r = generate(sampler.model, tok, ["12+7\n", "5\n"], group_size=3,
                 params=SamplingParams(max_new_tokens=8), seeds=list(range(6)))
    lp, _ = completion_logprobs(policy, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                r.response_mask)
    assert ((lp - r.logprobs) * r.response_mask).abs().max() < 0.05
    assert policy.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # untouched


def test_not_supported_for_peft_models():
    policy, _ = _tiny()
    assert bf16_copy_supported(policy)
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(policy, LoraConfig(r=2, target_modules=["q_proj"]))
    assert not bf16_copy_supported(lora)


def test_packed_linears_sample_exactly_what_plain_linears_do():
    """Where oneDNN's packed bf16 linear is used (CPU), the copy's samples and log-probs equal
    those of the same copy with plain ``nn.Linear`` calls, also after a sync (re-packed)."""
    from posttrain.models.bf16_copy import packed_linear_supported

    policy, tok = _tiny()
    sampler = BF16SamplingCopy(policy)
    if not packed_linear_supported():
        assert not sampler._packed  # nothing packed where it is not exact
        return
    assert len(sampler._packed) == 2 * 7  # q, k, v, o, gate, up, down per layer; not the head
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.5)
    sampler.sync()

    def run():
        return generate(sampler.model, tok, ["12+7\n", "5\n"], group_size=3,
                        params=SamplingParams(max_new_tokens=8), seeds=list(range(6)))

    packed = run()
    plain = {m: m.__dict__.pop("forward") for m in sampler._linears}  # back to nn.Linear
    unpacked = run()
    for m, fwd in plain.items():
        m.forward = fwd
    assert torch.equal(packed.completion_ids, unpacked.completion_ids)
    assert torch.equal(packed.logprobs, unpacked.logprobs)


def test_fp32_kv_cache_where_it_pays_scores_like_the_bf16_cache(monkeypatch):
    """On a CPU where it pays (no AMX) the copy keeps its KV cache in fp32 and attends in fp32
    (the prefill too): the cache holds fp32 and every step's log-probs match the same copy on
    bf16 sdpa to bf16 rounding, with left padding and grouped-query heads. Where it does not
    pay, the copy keeps sdpa and a bf16 cache."""
    import posttrain.models.bf16_copy as bf16_copy
    from posttrain.models.bf16_copy import DECODE_ATTENTION
    from posttrain.rollout.kv_cache import decode_cache

    tok = build_char_tokenizer()
    policy = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=64, seed=0)
    monkeypatch.setattr(bf16_copy, "fp32_decode_attention_pays", lambda: False)
    amx = BF16SamplingCopy(policy).model  # as on an AMX CPU
    assert amx.config._attn_implementation == "sdpa"
    assert getattr(amx, "kv_cache_dtype", None) is None
    monkeypatch.setattr(bf16_copy, "fp32_decode_attention_pays", lambda: True)
    sampler = BF16SamplingCopy(policy)
    assert sampler.model.config._attn_implementation == DECODE_ATTENTION
    cache = decode_cache(sampler.model, 16)
    with torch.no_grad():
        sampler.model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True,
                      past_key_values=cache)
    assert cache.layers[0].keys.dtype == torch.float32 and cache.layers[0].length == 3
    prompts = ["12+7\n", "5\n"]  # different lengths: the shorter one is left padded
    ours = generate(sampler.model, tok, prompts, group_size=3,
                    params=SamplingParams(max_new_tokens=8), seeds=list(range(6)))
    lp, _ = completion_logprobs(amx, ours.prompt_ids, ours.prompt_mask,
                                ours.completion_ids, ours.response_mask)
    # measured 0.001; the same attention without its padding mask: 0.086
    assert ((lp - ours.logprobs) * ours.response_mask).abs().max() < 0.005
    assert ours.response_mask.sum() > 6  # it decoded past the first token


def test_fp32_kv_cache_carried_across_turns_scores_like_the_policy(monkeypatch):
    """Multi-turn sampling on the copy's fp32 cache: the carried keys/values stay fp32 and the
    second turn's tokens, continued on them, score like the fp32 policy on the whole context
    (left padded) to bf16 rounding: the carried cache holds the right columns."""
    import posttrain.models.bf16_copy as bf16_copy
    import posttrain.rollout.hf as hf

    monkeypatch.setattr(bf16_copy, "fp32_decode_attention_pays", lambda: True)
    policy, tok = _tiny()
    sampler = BF16SamplingCopy(policy)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ctx = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12+7\n", "3*4-1\n", "5\n"]]
    keys, params = [0, 1, 2], SamplingParams(max_new_tokens=0)
    toks, mask, _, _, carried = hf.sample_turn(sampler.model, ctx, keys, [5, 7, 6], params,
                                               eos, pad, uniforms=hf.sequence_uniforms(keys, 7))
    assert carried and all(kv[0][0].dtype == torch.float32 for _, kv, _ in carried)
    answer = tok("<tool_response>42</tool_response>\n", add_special_tokens=False)["input_ids"]
    ctx = [c + toks[i, :int(mask[i].sum())].tolist() + answer for i, c in enumerate(ctx)]
    toks, mask, lps, _, _ = hf.sample_turn(sampler.model, ctx, keys, [6, 6, 6], params, eos,
                                           pad, uniforms=hf.sequence_uniforms([7, 8, 9], 6),
                                           carried=carried)
    width = max(map(len, ctx))
    ids = torch.full((3, width), pad)
    pm = torch.zeros((3, width), dtype=torch.bool)
    for i, c in enumerate(ctx):
        ids[i, width - len(c):], pm[i, width - len(c):] = torch.tensor(c), True
    want, _ = completion_logprobs(policy, ids, pm, toks, mask)
    assert mask.sum() >= 3
    # measured 0.001; halving the carried values (a wrong carry) gave 0.019
    assert ((want - lps) * mask).abs().max() < 0.005
