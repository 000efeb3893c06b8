"""One logits path: the learner's `completion_logits` is the model's own forward, so families
that transform logits after the LM head (Gemma-2 final-logit softcapping, Granite
`logits_scaling`) give the same log-probs when sampling and when training."""

from __future__ import annotations

import pytest
import torch

from posttrain.engine import forward
from posttrain.engine.forward import PolicyForward, completion_logits, completion_logprobs
from posttrain.rollout import SamplingParams, generate
from posttrain.tasks.tiny import build_tiny_gemma2
from posttrain.tasks.tokenizer import build_char_tokenizer

PROMPTS = ["12+7\n", "3*4-1\n", "5\n"]


def _tiny_granite(tok):
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                           logits_scaling=0.25, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    return GraniteForCausalLM(config)


@pytest.fixture(scope="module", params=["gemma2_softcap", "granite_logits_scaling"])
def family(request):
    tok = build_char_tokenizer()
    if request.param == "gemma2_softcap":
        model = build_tiny_gemma2(tok, final_logit_softcapping=2.0, sliding_window=8)
    else:
        model = _tiny_granite(tok)
    return model.eval(), tok


def test_sampler_logprobs_equal_learner_logprobs(family):
    """Gemma-2 with softcapping (and sliding-window layers shorter than the sequences), Granite
    with logit scaling: sampler log-probs == learner log-probs in fp32. The pre-fix learner ran
    decoder + LM head by hand and skipped the cap / the scaling (differences of ~1e-1)."""
    model, tok = family
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.95)
    r = generate(model, tok, PROMPTS, group_size=3, params=params,
                 generator=torch.Generator().manual_seed(0))
    assert r.response_mask.sum(1).max() > 8  # longer than the sliding window
    lp, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                r.response_mask, temperature=params.temperature)
    diff = ((lp - r.logprobs) * r.response_mask).abs().max()
    assert diff < 1e-5, diff
    lp2 = PolicyForward(temperature=params.temperature).batched(
        model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.response_mask, micro_batch_size=4)
    assert torch.allclose(lp2, lp, atol=1e-6)


def test_completion_logits_are_the_models_logits(family):
    """completion_logits == the model's full forward logits at the predicting positions."""
    model, tok = family
    r = generate(model, tok, PROMPTS, params=SamplingParams(max_new_tokens=6, greedy=True))
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    attn = torch.cat([r.prompt_mask, r.response_mask], 1).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        got = completion_logits(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                r.response_mask)
    T = got.shape[1]
    P = r.prompt_ids.shape[1]
    want = full[:, P - 1 : P - 1 + T]
    m = r.response_mask[:, :T]
    assert (got - want)[m].abs().max() < 1e-5
    if model.config.model_type == "gemma2":
        assert got.abs().max() <= model.config.final_logit_softcapping + 1e-4
        raw = model.get_output_embeddings()(
            model.model(input_ids=ids, attention_mask=attn,
                                position_ids=pos).last_hidden_state)
        assert raw.abs().max() > model.config.final_logit_softcapping  # the cap is active


def test_gradients_flow_through_the_head_context(family):
    model, tok = family
    r = generate(model, tok, PROMPTS[:2], params=SamplingParams(max_new_tokens=5, greedy=True))
    model.zero_grad()
    lp, _ = completion_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                r.response_mask, autocast=True)
    (lp * r.response_mask).sum().backward()
    head = model.get_output_embeddings().weight
    assert head.grad is not None and head.grad.abs().sum() > 0
    assert lp.dtype == torch.float32
    model.zero_grad()


def test_cpu_autocast_backward_uses_eager_attention_and_restores_sdpa():
    """Under CPU bf16 autocast the learner's attention is transformers' eager one (faster to
    differentiate than SDPA's CPU flash kernel), with grad and without (the reference must
    equal the learner before an update); the model is back on sdpa afterwards, the fp32 path is
    untouched, and the log-probs agree with sdpa's up to bf16 rounding."""
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from posttrain.tasks.tiny import build_tiny_llama

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=0)
    model.set_attn_implementation("sdpa")
    gen = torch.Generator().manual_seed(0)
    p_ids = torch.randint(10, 90, (3, 4), generator=gen)
    c_ids = torch.randint(10, 90, (3, 5), generator=gen)
    p_mask, c_mask = torch.ones(3, 4, dtype=torch.bool), torch.ones(3, 5, dtype=torch.bool)
    seen: list[str] = []
    real = sdpa_attention.sdpa_attention_forward

    def spy(*a, **k):
        seen.append("sdpa")
        return real(*a, **k)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = spy
    try:
        with torch.no_grad():
            ref, _ = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, autocast=True)
        assert not seen, "the no-grad forward runs eager attention too"
        lp, _ = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, autocast=True)
        assert not seen, "the differentiated forward runs eager attention"
        assert torch.equal(lp.detach(), ref)  # the reference's path is the learner's
        with torch.no_grad():
            sdpa, _ = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, autocast=False)
        assert seen, "fp32 keeps sdpa"
        lp.sum().backward()
        assert model.config._attn_implementation == "sdpa"
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = real
    assert (lp.detach() - sdpa).abs().max() < 0.05


def test_tied_embedding_gradient_is_added_in_place_and_equals_autograds():
    """A tied input embedding's gradient is scattered into the shared weight's .grad by a hook
    (no second dense [V, H] gradient): over two accumulated micro-batches, with padding, the
    result equals plain autograd's, and the model is restored afterwards."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    emb = model.get_input_embeddings()
    assert emb.weight is model.get_output_embeddings().weight and emb.padding_idx is not None
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        p_ids = torch.randint(10, 90, (3, 4), generator=gen)
        p_ids[0, :2] = tok.pad_token_id  # left padding
        p_mask = p_ids != tok.pad_token_id
        c_ids = torch.randint(10, 90, (3, 6), generator=gen)
        batches.append((p_ids, p_mask, c_ids, torch.ones(3, 6, dtype=torch.bool)))
    grads = []
    for in_place in (False, True):
        model.zero_grad(set_to_none=True)
        for p_ids, p_mask, c_ids, c_mask in batches:
            if in_place:  # the learner's entry point
                lp, _ = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, fused=True)
            else:  # the same fused forward under plain autograd
                lp, _ = forward._fused_logprobs(model, p_ids, p_mask, c_ids, c_mask, 1.0, False,
                                                False)
            (lp * c_mask).sum().backward()
        grads.append(emb.weight.grad.clone())
        assert "forward" not in emb.__dict__
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6), (grads[0] - grads[1]).abs().max()
    assert grads[1][tok.pad_token_id].abs().sum() == grads[0][tok.pad_token_id].abs().sum()


def test_the_run_decides_its_forward_once():
    """`policy_forward` is the one place precision, prompt sharing and temperature are chosen:
    bf16 autocast only without bf16_compute (its copy is bf16 already); prompt sharing off
    under torch_compile, FSDP2 and for trainers whose rows never repeat a prompt (SFT); the
    sampling temperature for RL trainers, 1 for DPO and SFT."""
    from posttrain.config import DPOConfig, GRPOConfig, SFTConfig
    from posttrain.engine.forward import policy_forward
    from posttrain.trainers.dpo import DPOTrainer
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.sft import SFTTrainer

    grpo = GRPOConfig(temperature=0.7, autocast_bf16=True)
    assert policy_forward(grpo, temperature=0.7) == PolicyForward(
        autocast=True, share_prefix=True, temperature=0.7)  # the trainer passes its own
    assert not policy_forward(GRPOConfig(autocast_bf16=True, bf16_compute=True)).autocast
    assert not policy_forward(grpo, fsdp=True).share_prefix
    assert not policy_forward(GRPOConfig(torch_compile=True)).share_prefix
    assert policy_forward(DPOConfig(), shares_prompts=DPOTrainer.shares_prompts) == \
        PolicyForward(share_prefix=True, temperature=1.0)
    assert policy_forward(SFTConfig(), shares_prompts=SFTTrainer.shares_prompts) == \
        PolicyForward(share_prefix=False, temperature=1.0)
    assert GRPOTrainer.shares_prompts
