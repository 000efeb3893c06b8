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


@pytest.mark.parametrize(("cls", "key", "hint"), [
    (GRPOConfig, "num_generations", "Did you mean group_size?"),
    (GRPOConfig, "learning_rate", "Did you mean lr?"),
    (GRPOConfig, "beta", "Did you mean kl_coef?"),
    (PPOConfig, "beta", "Did you mean kl_coef?"),
    (GRPOConfig, "max_completion_length", "Did you mean max_new_tokens?"),
    (GRPOConfig, "per_device_train_batch_size", "Did you mean prompts_per_step"),
    (DPOConfig, "per_device_train_batch_size", "Did you mean batch_size?"),
    (SFTConfig, "per_device_train_batch_size", "Did you mean batch_size?"),
    (GRPOConfig, "reward_funcs", "Did you mean rewards?"),
    (GRPOConfig, "train_dataset", "Did you mean train_data?"),
    (GRPOConfig, "processing_class", "Did you mean the `tokenizer=` argument"),
])
def test_trl_names_get_our_name(cls, key, hint):
    with pytest.raises(ConfigError) as err:
        _build(cls, **{key: 1})
    assert f"unknown config key '{key}'. {hint}" in str(err.value)
    assert f"'{key}' is TRL's name" in str(err.value)


def test_dpo_beta_is_its_own_key():
    assert _build(DPOConfig, beta=0.2).beta == 0.2


@pytest.mark.parametrize(("value", "expected"), [
    ("tensorboard", ["tensorboard"]), ("none", []), (["none"], []), ("None", []),
    ("tensorboard,wandb", ["tensorboard", "wandb"]), ([], []),
])
def test_report_to_accepts_trl_spellings(value, expected):
    assert _build(GRPOConfig, report_to=value).report_to == expected
    assert GRPOConfig(report_to=value).report_to == expected


def test_a_config_object_validates_when_made():
    with pytest.raises(ConfigError, match="lr='abc': expected a number"):
        GRPOConfig(group_size=4, lr="abc")
    with pytest.raises(ConfigError, match="'group_size'=1"):
        GRPOConfig(group_size=1)
    with pytest.raises(ConfigError, match="'dtype'=bfloat16"):
        SFTConfig(dtype="bfloat16")
    with pytest.raises(ConfigError, match="max_steps='10': expected an integer"):
        GRPOConfig(max_steps="10")
    # no model or train_data yet: those come with the trainer's objects
    cfg = GRPOConfig(lr=1, out_dir=__import__("pathlib").Path("runs/x"), adam_betas=(0.9, 0.95))
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.out_dir == "runs/x"
    assert cfg.adam_betas == [0.9, 0.95]
    with pytest.raises(ConfigError, match="'model': required"):
        build_config(GRPOConfig, overrides={"train_data": "d"}, base=cfg)


# ---- issue 57 items 4 and 5: keys this run would not read -----------------------------------
@pytest.mark.parametrize("keys", [{"max_staleness": 1}, {"max_staleness": 0},
                                  {"sampler_threads": 2}])
def test_async_keys_without_async_rollouts_are_refused(keys):
    with pytest.raises(ConfigError) as err:
        _build(GRPOConfig, **keys)
    message = str(err.value)
    assert "\n" not in message and f"'{next(iter(keys))}'" in message
    assert "only read with async_rollouts: true" in message and "async_rollouts: false" in message
    assert _build(GRPOConfig, async_rollouts=True, **keys).async_rollouts
    with pytest.raises(ConfigError, match="'max_staleness'=3"):
        GRPOConfig(max_staleness=3)  # the Python API: a value away from the default


@pytest.mark.parametrize("key, value, engine", [
    ("vllm_server_host", "10.0.0.2", "vllm_server"), ("vllm_server_port", 8001, "vllm_server"),
    ("vllm_gpu_memory_utilization", 0.5, "vllm_colocate"),
    ("vllm_push_check", 0.2, "vllm_colocate or vllm_server")])
def test_trl_server_keys_with_the_hf_engine_name_the_engine_they_need(key, value, engine):
    for cls in (GRPOConfig, PPOConfig):
        with pytest.raises(ConfigError) as err:
            _build(cls, **{key: value})
        assert str(err.value) == (
            f"config key '{key}'={value!r}: only read with rollout_engine: {engine}, and this "
            f"run has rollout_engine: hf; set rollout_engine: {engine}, or drop it")


def test_a_whole_config_yaml_with_its_defaults_is_accepted(tmp_path):
    """A run's own config.yaml (every key, at its default) given back as a recipe."""
    import dataclasses

    import yaml

    cfg = _build(GRPOConfig)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    assert build_config(GRPOConfig, path) == cfg


# ---- issue 58 item 3: async_rollouts with a vLLM sampler ---------------------------------------
@pytest.mark.parametrize(("keys", "needle"), [
    ({"rollout_engine": "vllm_colocate"}, "'rollout_engine'='vllm_colocate': not implemented with "
     "async_rollouts (the sampler process runs hf or talks to a vllm_server)"),
    ({"rollout_engine": "vllm_server", "eval_every": 5}, "'eval_every'=5: not implemented with "
     "async_rollouts (a mid-run evaluation would push the learner's weights to the server"),
])
def test_async_with_a_vllm_engine_refuses_what_it_does_not_cover(keys, needle, monkeypatch):
    from posttrain.config import sampler as sampler_checks

    monkeypatch.setattr(sampler_checks, "vllm_available", lambda: True)
    monkeypatch.setattr(sampler_checks, "vllm_cpu_build", lambda: True)
    with pytest.raises(ConfigError) as err:
        _build(GRPOConfig, async_rollouts=True, **keys)
    assert needle in str(err.value) and "\n" not in str(err.value)
    cfg = _build(GRPOConfig, async_rollouts=True, rollout_engine="vllm_server")
    assert cfg.async_rollouts and cfg.rollout_engine == "vllm_server"
