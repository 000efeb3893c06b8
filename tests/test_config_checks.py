"""Config checks added for issues 22 and 24: kl_clamp, dtype, TRL names, config objects."""

from __future__ import annotations

import pytest

from posttrain.config import (
    ConfigError,
    DPOConfig,
    GRPOConfig,
    PPOConfig,
    RMConfig,
    SearchConfig,
    SFTConfig,
    build_config,
)


def _build(cls, **kw):
    return build_config(cls, overrides={"model": "m", "train_data": "d.jsonl", **kw})


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_kl_clamp_default_and_range(cls):
    assert _build(cls).kl_clamp == 10.0
    assert _build(cls, kl_clamp=0).kl_clamp == 0.0
    with pytest.raises(ConfigError, match="'kl_clamp'=-1.0"):
        _build(cls, kl_clamp=-1)


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig, DPOConfig, SFTConfig, RMConfig])
def test_bf16_weights_refused_for_a_full_fine_tune(cls):
    with pytest.raises(ConfigError) as err:
        _build(cls, dtype="bfloat16")
    message = str(err.value)
    assert "'dtype'=bfloat16" in message and "bf16_compute" in message
    assert "autocast_bf16" in message and "\n" not in message


def test_bf16_weights_allowed_with_lora_and_for_search():
    assert _build(GRPOConfig, dtype="bfloat16", lora_r=8).dtype == "bfloat16"
    cfg = build_config(SearchConfig, overrides={"model": "m", "eval_data": "d.jsonl",
                                                "dtype": "bfloat16", "methods": ["majority"]})
    assert cfg.dtype == "bfloat16"


def test_lora_adapters_stay_fp32_on_a_bf16_base():
    """What allowing bf16 with LoRA relies on: peft creates the trainable adapters in fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models import apply_lora

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2)).to(torch.bfloat16)
    peft_model = apply_lora(model, r=2, target_modules=["q_proj", "v_proj"])
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
