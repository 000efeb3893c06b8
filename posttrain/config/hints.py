"""Names posttrain shares with TRL and verl: the did-you-mean for their names, and the notes for
names that exist in both worlds with another meaning (docs/trainers.md "Names from TRL and
verl").

A hint names the key with the same meaning, never a look-alike: verl's `max_response_length`
is our `max_new_tokens` (not `max_prompt_len`), its `data.train_batch_size` our
`prompts_per_step`. Pure Python, no posttrain imports.
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
}
_TRL_NOTES: dict[str, str] = {
    "processing_class": "the `tokenizer=` argument of the trainer (Python API)",
    "bf16": "bf16_compute or autocast_bf16 (weights stay fp32)",
    "num_train_epochs": "max_steps (posttrain counts steps, not epochs)",
    "warmup_ratio": "warmup_steps (a count of optimizer steps, not a fraction)",
    "gradient_accumulation_steps": "micro_batch_size (sequences per forward/backward; the "
                                   "step's batch is accumulated in micro-batches)",
}
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
}
# names that mean something else here than in TRL / verl: said once, when a config sets them
SHARED_NAMES: dict[str, str] = {
    "generation_batch_size": (
        "generation_batch_size is posttrain's generation memory bound (sequences per "
        "generation batch; the step's size does not change); TRL's generation_batch_size, the "
        "completions sampled per step, is prompts_per_step * group_size here"),
}
_noted: set[str] = set()


def _trl_hint(key: str, valid: list[str]) -> str | None:
    """A hint for a TRL name, if it has an equivalent in this config."""
    if key == "per_device_train_batch_size":
        if "prompts_per_step" in valid:
            return ("prompts_per_step (prompts per step; TRL counts completions: "
                    "per_device_train_batch_size = prompts_per_step * group_size) and "
                    "micro_batch_size (sequences per forward/backward)")
        return "batch_size" if "batch_size" in valid else None
    if key in _TRL_NOTES and key not in TRL_NAMES:
        return _TRL_NOTES[key]
    target = TRL_NAMES.get(key)
    if target is None or (target not in valid and target != "tokenizer"):
        return None
    return _TRL_NOTES.get(key, target)


def _verl_hint(key: str, valid: list[str]) -> str | None:
    """Our key for a verl name (`data.train_batch_size`, `actor_rollout_ref.rollout.n`)."""
    parts = key.split(".")
    for i in range(len(parts)):
        target = VERL_NAMES.get(".".join(parts[i:]))
        if target is not None:
            return target if target in valid else None
    return None


def unknown_key_message(key: str, valid: list[str], where: str, with_valid: bool = True) -> str:
    """"unknown config key 'k'. Did you mean ...?" with the key of the same meaning for a TRL
    or verl name, else the closest spellings; `with_valid`: append every valid key."""
    trl, verl = _trl_hint(key, valid), _verl_hint(key, valid)
    if trl is not None:
        hint = f" Did you mean {trl}? ('{key}' is TRL's name)"
    elif verl is not None:
        hint = f" Did you mean {verl}? ('{key}' is verl's name)"
    else:
        close = difflib.get_close_matches(key.split(".")[-1], valid, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
    tail = f" Valid keys: {', '.join(valid)}" if with_valid else ""
    return f"{where}unknown config key '{key}'.{hint}{tail}"


def note_shared_names(keys: list[str]) -> None:
    """Say once per process, on stderr, what a shared name means here (`SHARED_NAMES`)."""
    for key in keys:
        if key in SHARED_NAMES and key not in _noted:
            _noted.add(key)
            print(f"posttrain: note: {SHARED_NAMES[key]}", file=sys.stderr)
