"""Hints per trainer (issue 48, items 5, 13, 14): every TRL / verl name is hinted, in each
trainer, to the key with the same meaning there, or to no key with what to do instead.

The meanings below are written independently of posttrain/config/hints.py: a hint added there
without its meaning here fails, and so does one that names a look-alike.
"""

from __future__ import annotations

import dataclasses

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError, GRPOConfig, build_config
from posttrain.config.hints import TRL_NAMES, VERL_NAMES, foreign_hint, unknown_key_message
from posttrain.trainers import TRAINERS, config_class

NAMES_BY_MEANING: dict[str, list[str]] = {  # what TRL's / verl's names mean (where they exist)
    "completions per prompt": ["num_generations", "rollout.n"],
    "peak learning rate": ["learning_rate", "optim.lr"],
    "KL coefficient": ["beta", "kl_loss_coef", "kl_ctrl.kl_coef"],
    "sampled tokens per completion": ["max_completion_length", "max_response_length",
                                      "response_length"],
    "rewards of training samples": ["reward_funcs", "reward_model_path", "judge"],
    "training data": ["train_dataset", "dataset_name", "train_files"],
    "held-out data": ["eval_dataset", "val_files"],
    "output directory": ["output_dir", "default_local_dir"],
    "tokenizer": ["processing_class"], "policy model": ["model_name_or_path", "model.path"],
    "log cadence": ["logging_steps"], "checkpoint cadence": ["save_steps", "save_freq"],
    "evaluation cadence": ["eval_steps", "test_freq"],
    "learning-rate schedule": ["lr_scheduler_type"],
    "lower clip range": ["epsilon", "clip_ratio", "clip_ratio_low"],
    "upper clip range": ["epsilon_high", "clip_ratio_high"],
    "advantage scaling": ["scale_rewards"], "longest training row": ["max_length"],
    "loss aggregation": ["loss_type", "loss_agg_mode"], "bf16 compute": ["bf16"],
    "training length": ["max_steps_per_epoch", "num_train_epochs", "total_training_steps",
                        "total_epochs"],
    "longest prompt": ["max_prompt_length"], "warm-up length": ["warmup_ratio"],
    "micro-batching": ["gradient_accumulation_steps", "ppo_micro_batch_size_per_gpu"],
    "sampling engine": ["use_vllm", "vllm_mode", "rollout.name"],
    "chosen NLL weight": ["cpo_alpha"],
    "logged samples per step": ["num_completions_to_print"],
    "batch per step": ["per_device_train_batch_size", "train_batch_size"],
    "KL estimator": ["kl_loss_type"], "advantage estimator": ["adv_estimator"],
    "epochs over a step's samples": ["ppo_epochs"], "entropy bonus": ["entropy_coeff"],
    "tool-calling rounds": ["max_turns", "max_assistant_turns", "max_user_turns"],
    # issue 57: TRL's rollout correction (its modes have our names) and two-sided GRPO's bound
    "sampler/learner importance correction": ["vllm_importance_sampling_correction",
                                              "vllm_importance_sampling_mode"],
    "importance ratio cap": ["vllm_importance_sampling_cap"],
    "bound on a negative advantage's ratio": ["delta"],
    "vLLM asleep while training": ["vllm_enable_sleep_mode"],
    "vLLM's longest sequence": ["vllm_max_model_length"],
    "where the vLLM server listens": ["vllm_server_base_url"],
}
THEIRS = {name: meaning for meaning, names in NAMES_BY_MEANING.items() for name in names}
OURS: dict[str, str] = {  # our key -> what it means (where the trainer has the key)
    "group_size": "completions per prompt", "lr": "peak learning rate", "kl_coef": "KL coefficient",
    "max_new_tokens": "sampled tokens per completion", "rewards": "rewards of training samples",
    "train_data": "training data", "eval_data": "held-out data", "out_dir": "output directory",
    "tokenizer": "tokenizer", "model": "policy model", "log_every": "log cadence",
    "save_every": "checkpoint cadence", "eval_every": "evaluation cadence",
    "lr_schedule": "learning-rate schedule", "clip_eps_low": "lower clip range",
    "clip_eps_high": "upper clip range", "scale": "advantage scaling",
    "max_seq_len": "longest training row", "loss_agg": "loss aggregation",
    "bf16_compute": "bf16 compute", "max_steps": "training length",
    "max_prompt_len": "longest prompt", "warmup_steps": "warm-up length",
    "micro_batch_size": "micro-batching", "rollout_engine": "sampling engine",
    "rpo_alpha": "chosen NLL weight",
    "log_completions": "logged samples per step", "prompts_per_step": "batch per step",
    "batch_size": "batch per step", "kl_estimator": "KL estimator",
    "advantage": "advantage estimator", "num_iterations": "epochs over a step's samples",
    "ent_coef": "entropy bonus", "max_tool_calling_iterations": "tool-calling rounds",
    "rollout_is": "sampler/learner importance correction", "rollout_is_cap": "importance ratio cap",
    "dual_clip": "bound on a negative advantage's ratio",
    "vllm_sleep": "vLLM asleep while training", "vllm_max_model_len": "vLLM's longest sequence",
    "vllm_server_host": "where the vLLM server listens",
}
BY_TRAINER = {("OnlineDPOConfig", "clip_eps_low"): "unused (no ratio)",
              ("OnlineDPOConfig", "clip_eps_high"): "unused (no ratio)"}
COMMANDS = [*TRAINERS, "search"]


def our_meaning(cls: type, key: str) -> str:
    if (cls.__name__, key) in BY_TRAINER:
        return BY_TRAINER[(cls.__name__, key)]
    return OURS[key]


def test_every_name_and_target_has_a_meaning():
    names = [*TRL_NAMES, *VERL_NAMES]
    assert [n for n in names if n not in THEIRS] == []
    assert [k for k in [*TRL_NAMES.values(), *VERL_NAMES.values()] if k not in OURS] == []


@pytest.mark.parametrize("command", COMMANDS)
def test_a_hint_names_a_key_of_the_same_meaning_in_that_trainer(command):
    cls = config_class(command)
    valid = [f.name for f in dataclasses.fields(cls)]
    for name in [*TRL_NAMES, *VERL_NAMES]:
        world, table_name, key, text = foreign_hint(name, valid, cls.__name__)
        message = unknown_key_message(name, valid, "", False, cls.__name__)
        if key is None:  # no key: says so and what to do, and names no look-alike
            assert "has no key with its meaning: " in message and "Did you mean" not in message
            continue
        assert key in valid or key == "tokenizer", f"{cls.__name__}: {name} -> {key}"
        assert our_meaning(cls, key) == THEIRS[table_name], f"{cls.__name__}: {name} -> {key}"
        assert message.startswith(f"unknown config key '{name}'. Did you mean {text}?")


@pytest.mark.parametrize(("command", "name", "hint"), [
    ("dpo", "max_completion_length", "no key with its meaning: rows are never truncated"),
    ("kto", "max_completion_length", "no key with its meaning: rows are never truncated here: "
                                     "max_seq_len bounds prompt + completion"),
    ("grpo", "max_completion_length", "Did you mean max_new_tokens?"),
    ("online_dpo", "max_completion_length", "Did you mean max_new_tokens?"),
    ("grpo", "use_vllm", "Did you mean rollout_engine (use_vllm: true is rollout_engine: "
                         "vllm_colocate or vllm_server)?"),
    ("grpo", "vllm_mode", "vllm_mode colocate is rollout_engine: vllm_colocate"),
    ("grpo", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
     "Did you mean max_tool_calling_iterations"),
    ("ppo", "multi_turn.max_user_turns", "Did you mean max_tool_calling_iterations"),
    ("grpo", "max_turns", "Did you mean max_tool_calling_iterations"),
    ("grpo", "actor_rollout_ref.rollout.name", "Did you mean rollout_engine (hf, vllm_colocate"),
    ("ppo", "reward_model_path", "{name: reward_model, path: DIR}"),
    ("online_dpo", "judge", "{name: reward_model, path: DIR}"),
    ("dpo", "reward_model_path", "no key with its meaning: this trainer trains on its rows'"),
    ("dpo", "cpo_alpha", "Did you mean rpo_alpha"),
    ("online_dpo", "epsilon", "no key with its meaning"),
    ("grpo", "num_completions_to_print", "Did you mean log_completions"),
    ("search", "per_device_train_batch_size", "no key with its meaning"),
    ("grpo", "vllm_importance_sampling_correction", "Did you mean rollout_is (TRL's true"),
    ("ppo", "vllm_importance_sampling_cap", "Did you mean rollout_is_cap?"),
    ("online_dpo", "vllm_importance_sampling_cap", "no key with its meaning"),
    ("grpo", "delta", "Did you mean dual_clip (TRL's two-sided GRPO bound"),
    ("grpo", "loss_type", "dr_grpo is seq-mean-token-sum-norm"),
    ("grpo", "vllm_model_impl", "no key with its meaning: vLLM picks its own"),
    ("grpo", "weight_sync_steps", "no key with its meaning: the weights go to the sampler"),
    ("grpo", "min_p", "no key with its meaning: sampling takes temperature, top_p and top_k"),
    ("ppo", "repetition_penalty", "no key with its meaning: sampling takes temperature"),
    ("grpo", "top_entropy_quantile", "no key with its meaning: every response token"),
    ("grpo", "vllm_server_base_url", "Did you mean vllm_server_host and vllm_server_port"),
    ("grpo", "vllm_enable_sleep_mode", "Did you mean vllm_sleep?"),
    ("grpo", "vllm_tensor_parallel_size", "no key with its meaning: vllm_colocate runs one"),
])
def test_trl_and_verl_habits_get_the_hint_of_that_trainer(command, name, hint):
    cls = config_class(command)
    needed = {k: "x" for k in ("model", "train_data") if k in cls.__dataclass_fields__}
    with pytest.raises(ConfigError) as err:
        build_config(cls, overrides={**needed, name: 1})
    message = str(err.value)
    assert hint in message and ("TRL's name" in message or "verl's name" in message)
    assert ("Did you mean" in message) == ("no key" not in hint)  # never a look-alike


def test_trl_null_for_max_tool_calling_iterations_says_what_trl_meant():
    with pytest.raises(ConfigError) as err:
        build_config(GRPOConfig, overrides={"model": "m", "train_data": "d",
                                            "max_tool_calling_iterations": None})
    message = str(err.value)
    assert "max_tool_calling_iterations=None: expected an integer" in message
    assert "TRL's null" in message and "no limit" in message and "max_new_tokens" in message
    with pytest.raises(ConfigError, match="TRL's null"):
        GRPOConfig(max_tool_calling_iterations=None)


@pytest.mark.parametrize(("command", "ours"), [("cpo", "posttrain dpo loss_type=simpo"),
                                               ("simpo", "posttrain dpo loss_type=simpo"),
                                               ("async_grpo", "posttrain grpo async_rollouts=")])
def test_trl_trainer_names_as_commands_name_ours(command, ours, capsys):
    assert main([command, "--config", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"posttrain: unknown command '{command}'" in err and ours in err


@pytest.mark.parametrize(("command", "key", "hint"), [
    ("ppo", "async_rollouts", "'async_rollouts' is a key of posttrain grpo, not of posttrain ppo"),
    ("sft", "group_size", "'group_size' is a key of posttrain grpo, posttrain online_dpo"),
    ("ppo", "simpo_gamma", "'simpo_gamma' is a key of posttrain dpo, posttrain online_dpo, not of "
                           "posttrain ppo"),  # issue 60: SimPO's margin has its own word now
])
def test_a_key_of_another_trainer_is_named_as_such_not_as_a_look_alike(command, key, hint):
    """Issue 57: `async_rollouts` on PPO was hinted "rollout_is?"."""
    with pytest.raises(ConfigError) as err:
        build_config(config_class(command), overrides={"model": "m", "train_data": "d", key: 1})
    assert hint in str(err.value) and "Did you mean" not in str(err.value)


def test_an_unknown_key_with_an_empty_mapping_is_named():
    """Issue 57: `generation_kwargs={}` was dropped without a word."""
    with pytest.raises(ConfigError) as err:
        build_config(GRPOConfig, overrides={"model": "m", "train_data": "d",
                                            "generation_kwargs": {}})
    assert "unknown config key 'generation_kwargs'" in str(err.value)
    assert "sampling takes temperature, top_p and top_k" in str(err.value)
