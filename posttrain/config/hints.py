"""Names posttrain shares with TRL and verl: the did-you-mean for their names, and the notes for
names that exist in both worlds with another meaning (docs/trainers.md "Names from TRL and
verl").

A hint is per trainer (config class): it names the key with the same meaning in that trainer,
or no key and what to do instead, never a look-alike (SFT's `eval_rewards` score held-out
samples only, not TRL's `reward_funcs`). Keys renamed here are read under their new name, said
in one line.
tests/config/test_hint_meanings.py checks every hint against a table of meanings. Pure Python.
"""

from __future__ import annotations

import difflib
import sys

# TRL's (and transformers.TrainingArguments') names -> ours
TRL_NAMES: dict[str, str] = {
    "num_generations": "group_size", "learning_rate": "lr", "beta": "kl_coef",
    "max_completion_length": "max_new_tokens", "reward_funcs": "rewards",
    "train_dataset": "train_data", "eval_dataset": "eval_data", "output_dir": "out_dir",
    "processing_class": "tokenizer", "logging_steps": "log_every", "save_steps": "save_every",
    "eval_steps": "eval_every", "lr_scheduler_type": "lr_schedule", "epsilon": "clip_eps_low",
    "epsilon_high": "clip_eps_high", "scale_rewards": "scale", "max_length": "max_seq_len",
    "model_name_or_path": "model", "dataset_name": "train_data", "loss_type": "loss_agg",
    "bf16": "bf16_compute", "max_steps_per_epoch": "max_steps", "num_train_epochs": "max_steps",
    "max_prompt_length": "max_prompt_len", "warmup_ratio": "warmup_steps",
    "gradient_accumulation_steps": "micro_batch_size", "use_vllm": "rollout_engine",
    "vllm_mode": "rollout_engine", "reward_model_path": "rewards", "judge": "rewards",
    "cpo_alpha": "rpo_alpha", "num_completions_to_print":
    "log_completions", "per_device_train_batch_size": "prompts_per_step",
    "vllm_importance_sampling_correction": "rollout_is",
    "vllm_importance_sampling_mode": "rollout_is", "vllm_importance_sampling_cap":
    "rollout_is_cap", "delta": "dual_clip", "vllm_enable_sleep_mode": "vllm_sleep",
    "vllm_max_model_length": "vllm_max_model_len", "vllm_server_base_url": "vllm_server_host",
}
# where the first key is not in a trainer: the key of the same meaning there
_SECOND: dict[str, str] = {"per_device_train_batch_size": "batch_size"}
_REWARD_MODEL = "rewards (an entry {name: reward_model, path: DIR}, docs/rewards.md)"
# what a hint says instead of the bare key
_NOTES: dict[str, str] = {
    "processing_class": "the `tokenizer=` argument of the trainer (Python API)",
    "bf16": "bf16_compute or autocast_bf16 (weights stay fp32)",
    "num_train_epochs": "max_steps (posttrain counts steps, not epochs)",
    "warmup_ratio": "warmup_steps (a count of optimizer steps, not a fraction)",
    "gradient_accumulation_steps": "micro_batch_size (sequences per forward/backward; the "
                                   "step's batch is accumulated in micro-batches)",
    "use_vllm": "rollout_engine (use_vllm: true is rollout_engine: vllm_colocate or vllm_server)",
    "vllm_mode": "rollout_engine (vllm_mode colocate is rollout_engine: vllm_colocate, server "
                 "is vllm_server)",
    "rollout.name": "rollout_engine (hf, vllm_colocate or vllm_server)",
    "reward_model_path": _REWARD_MODEL,
    "judge": f"{_REWARD_MODEL}: a scalar reward ranks the samples; there are no pairwise judges",
    "cpo_alpha": "rpo_alpha (the chosen completion's NLL weight; CPO-SimPO is loss_type: simpo "
                 "with rpo_alpha)",
    "num_completions_to_print": "log_completions (samples of each step written and printed)",
    "max_length": "max_seq_len (a longer row is an error, never truncated)",
    "per_device_train_batch_size": (
        "prompts_per_step (prompts per step; TRL counts completions: per_device_train_batch_size"
        " = prompts_per_step * group_size) and micro_batch_size (sequences per forward/backward)"),
    "max_turns": "max_tool_calling_iterations (rounds of tool calls per episode)",
    "loss_type": ("loss_agg (TRL's loss_type grpo is loss_agg: seq-mean-token-mean; dapo is "
                  "token-mean, over the step's tokens; bnpo, its per-device token mean, is "
                  "token-mean too; dr_grpo is seq-mean-token-sum-norm, with scale: none for the "
                  "whole Dr. GRPO)"),
    "vllm_importance_sampling_correction": (
        "rollout_is (TRL's true is a vllm_importance_sampling_mode, the same names here: auto "
        "is sequence_mask with a vLLM sampler; false is rollout_is: none)"),
    "vllm_importance_sampling_mode": "rollout_is (TRL's mode names: token_truncate, "
                                     "token_mask, sequence_truncate, sequence_mask)",
    "vllm_server_base_url": "vllm_server_host and vllm_server_port (TRL's http://HOST:PORT)",
    "delta": ("dual_clip (TRL's two-sided GRPO bound, INTELLECT-2: a ratio above delta counts "
              "as delta for a negative advantage, which is dual_clip: delta when delta > 1 + "
              "clip_eps_high)"),
}
_NOTES["max_assistant_turns"] = _NOTES["max_user_turns"] = _NOTES["max_turns"]
# verl's names (dotted as in its Hydra config; matched on their last components) -> ours
VERL_NAMES: dict[str, str] = {
    "max_response_length": "max_new_tokens", "response_length": "max_new_tokens",
    "train_batch_size": "prompts_per_step", "rollout.n": "group_size",
    "train_files": "train_data", "val_files": "eval_data", "model.path": "model",
    "optim.lr": "lr", "kl_loss_coef": "kl_coef", "kl_ctrl.kl_coef": "kl_coef",
    "kl_loss_type": "kl_estimator", "clip_ratio": "clip_eps_low",
    "clip_ratio_low": "clip_eps_low", "clip_ratio_high": "clip_eps_high",
    "loss_agg_mode": "loss_agg", "adv_estimator": "advantage", "ppo_epochs": "num_iterations",
    "ppo_micro_batch_size_per_gpu": "micro_batch_size", "total_training_steps": "max_steps",
    "total_epochs": "max_steps", "save_freq": "save_every", "test_freq": "eval_every",
    "default_local_dir": "out_dir", "entropy_coeff": "ent_coef",
    "max_prompt_length": "max_prompt_len",
    "max_turns": "max_tool_calling_iterations",
    "max_assistant_turns": "max_tool_calling_iterations",
    "max_user_turns": "max_tool_calling_iterations", "rollout.name": "rollout_engine",
}
# our keys that mean something else in some trainers (config classes) than the names hinted
# to them: there those names get no key
LOOK_ALIKES: dict[str, tuple[str, ...]] = {
    "clip_eps_low": ("OnlineDPOConfig",), "clip_eps_high": ("OnlineDPOConfig",),  # no ratio
    **{k: ("OnlineDPOConfig",) for k in ("dual_clip", "rollout_is", "rollout_is_cap")},
}
# what to do where a name has no key of its meaning (any other: docs/trainers.md)
_NOT_CUT = ("rows are never truncated here: max_seq_len bounds prompt + completion (a longer row "
            "is an error); eval_max_new_tokens is only the held-out generation budget")
_NO_SCORER = ("this trainer trains on its rows' labels; eval_rewards only score held-out "
              "samples (posttrain ppo / grpo / online_dpo take rewards)")
_SIMPO = ("SimPO and CPO are `posttrain dpo loss_type=simpo` (simpo_gamma: the margin, rpo_alpha: "
          "the NLL weight)")
_NO_KEY: dict[str, str] = {
    "max_completion_length": _NOT_CUT, "max_prompt_length": _NOT_CUT,
    "max_response_length": _NOT_CUT, "reward_model_path": _NO_SCORER, "judge": _NO_SCORER,
    "cpo_alpha": _SIMPO,
    "max_length": "GRPO, PPO and online DPO sequences are at most max_prompt_len + "
                  "max_new_tokens tokens",
}
# TRL's names with no key of their meaning in any trainer: what to do instead
TRL_ONLY: dict[str, str] = {
    "vllm_model_impl": "vLLM picks its own implementation of the model (for vllm_server, start "
                       "`vllm serve` with --model-impl)",
    "weight_sync_steps": "the weights go to the sampler after every policy update (vLLM "
                         "samplers and async_rollouts alike; docs/async.md)",
    "vllm_tensor_parallel_size": "vllm_colocate runs one sampler per trainer process, on its "
                                 "GPU; for tensor parallelism serve the model with `vllm serve "
                                 "--tensor-parallel-size N` and use rollout_engine: vllm_server",
    "min_p": "sampling takes temperature, top_p and top_k only",
    "generation_kwargs": "sampling takes temperature, top_p and top_k, each its own key",
    "repetition_penalty": "sampling takes temperature, top_p and top_k only (a penalty would "
                          "sample from another distribution than the learner's log-probs)",
    "top_entropy_quantile": "every response token is in the loss (no high-entropy token "
                            "selection)",
}
# our keys that only some trainers have -> the commands that have them
CONFIG_COMMANDS = {"SFTConfig": "sft", "GRPOConfig": "grpo", "PPOConfig": "ppo",
                   "DPOConfig": "dpo", "KTOConfig": "kto", "OnlineDPOConfig": "online_dpo",
                   "RMConfig": "rm", "PRMConfig": "prm", "SearchConfig": "search"}
# our keys renamed (issue 60: one word per thing) -> the new name, used where the old one is not
# a key of the trainer and the new one is (`max_new_tokens` stays GRPO's, PPO's sampling budget)
RENAMED: dict[str, str] = {"max_new_tokens": "eval_max_new_tokens", "gamma": "simpo_gamma",
                           "rewards": "eval_rewards", "batch_size": "generation_batch_size"}
# renames that hold in these trainers only (GRPO's generation_batch_size is no batch_size)
RENAMED_ONLY_IN: dict[str, tuple[str, ...]] = {"batch_size": ("SearchConfig",)}


def renamed_key(key: str, valid: list[str], trainer: str = "") -> str:
    """`key` itself, or its new name where only that is valid (said in one line on stderr)."""
    new = RENAMED.get(key)
    if new is None or key in valid or new not in valid or trainer not in RENAMED_ONLY_IN.get(
            key, (trainer,)):
        return key
    print(f"posttrain: config key '{key}' is now '{new}' in posttrain "
          f"{CONFIG_COMMANDS.get(trainer, trainer)}: read as '{new}'", file=sys.stderr)
    return new


# names that mean something else here than in TRL / verl: said once, when a config sets them
SHARED_NAMES: dict[str, str] = {
    "generation_batch_size": (
        "generation_batch_size is posttrain's generation memory bound (sequences per "
        "generation batch; the step's size does not change); TRL's generation_batch_size, the "
        "completions sampled per step, is prompts_per_step * group_size here"),
}
# what TRL's null means for a key that takes a number here: said with the type error
TRL_NULLS: dict[str, str] = {
    "max_tool_calling_iterations": (
        "TRL's null (its default) means no limit on tool-calling rounds; here set a count (e.g. "
        "16): the whole episode is bounded by max_new_tokens either way"),
}
_noted: set[str] = set()


def _usable(target: str, valid: list[str], trainer: str) -> bool:
    """Whether `target` is a key of this trainer with the meaning of the names hinted to it."""
    return (target in valid or target == "tokenizer") and trainer not in LOOK_ALIKES.get(
        target, ())


def _foreign(key: str) -> tuple[str, str, str] | None:
    """(world, name as in the tables, our key) for a TRL or verl name."""
    if key in TRL_NAMES:
        return "TRL", key, TRL_NAMES[key]
    parts = key.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[i:])
        if name in VERL_NAMES:
            return "verl", name, VERL_NAMES[name]
    return None


def foreign_hint(key: str, valid: list[str], trainer: str = "") -> tuple[str, str, str | None,
                                                                         str] | None:
    """For a TRL or verl name in `trainer` (a config class name): (its world, its name in the
    tables, our key of the same meaning or None when this trainer has none, the hint's text:
    that key with its note, or what to do instead)."""
    if key in TRL_ONLY:
        return "TRL", key, None, TRL_ONLY[key]
    found = _foreign(key)
    if found is None:
        return None
    world, name, target = found
    for key_here, text in ((target, _NOTES.get(name, target)),
                           (_SECOND.get(name, ""), _SECOND.get(name, ""))):
        if key_here and _usable(key_here, valid, trainer):
            return world, name, key_here, text
    return world, name, None, _NO_KEY.get(name, "see docs/trainers.md, Names from TRL and verl")


def unknown_key_message(key: str, valid: list[str], where: str, with_valid: bool = True,
                        trainer: str = "", elsewhere: tuple[str, ...] = ()) -> str:
    """"unknown config key 'k'. Did you mean ...?" with the key of the same meaning in
    `trainer` (a config class name) for a TRL or verl name (or that it has none, and what to
    do), else the trainers that have the key (`elsewhere`: config class names), else the
    closest spellings; `with_valid`: append every valid key."""
    foreign = foreign_hint(key, valid, trainer)
    others = [CONFIG_COMMANDS[c] for c in elsewhere if c in CONFIG_COMMANDS]
    if foreign is None and others:
        here = f"posttrain {CONFIG_COMMANDS[trainer]}" if trainer in CONFIG_COMMANDS else \
            "this trainer"
        hint = (f" '{key}' is a key of {', '.join(f'posttrain {c}' for c in others)}, not of "
                f"{here}")
    elif foreign is None:
        close = difflib.get_close_matches(key.split(".")[-1], valid, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
    elif foreign[2] is not None:
        hint = f" Did you mean {foreign[3]}? ('{key}' is {foreign[0]}'s name)"
    else:
        hint = (f" '{key}' is {foreign[0]}'s name; this trainer has no key with its meaning: "
                f"{foreign[3]}")
    tail = f" Valid keys: {', '.join(valid)}" if with_valid else ""
    return f"{where}unknown config key '{key}'.{hint}{tail}"


def null_note(key: str) -> str:
    """What TRL's null means for `key`, said with the type error of a null."""
    return f": {TRL_NULLS[key]}" if key in TRL_NULLS else ""


def note_shared_names(keys: list[str]) -> None:
    """Say once per process, on stderr, what a shared name means here (`SHARED_NAMES`)."""
    for key in keys:
        if key in SHARED_NAMES and key not in _noted:
            _noted.add(key)
            print(f"posttrain: note: {SHARED_NAMES[key]}", file=sys.stderr)
