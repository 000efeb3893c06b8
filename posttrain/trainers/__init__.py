"""The algorithms: one thin subclass of :class:`posttrain.engine.Trainer` each.

``TRAINERS`` is the one registry: each CLI command -> its trainer class (imported lazily, so
``posttrain --help`` stays fast) and a one-line description. The trainer class names its config
(``config_class``), so a new algorithm adds one line here and nothing elsewhere.
"""

from __future__ import annotations

import importlib
from typing import Any

TRAINERS: dict[str, tuple[str, str]] = {
    "sft": ("posttrain.trainers.sft:SFTTrainer",
            "supervised fine-tuning on {prompt, completion} rows (the warm start)"),
    "grpo": ("posttrain.trainers.grpo:GRPOTrainer",
             "GRPO / GSPO / DAPO / Dr. GRPO with reward functions (see recipes/)"),
    "dpo": ("posttrain.trainers.dpo:DPOTrainer",
            "DPO / cDPO / robust DPO / IPO / hinge / SimPO on preference pairs (no reward model)"),
    "kto": ("posttrain.trainers.kto:KTOTrainer",
            "KTO on unpaired {prompt, completion, label} rows (desirable / undesirable)"),
    "online_dpo": ("posttrain.trainers.online_dpo:OnlineDPOTrainer",
                   "online DPO: sample G per prompt, rank with rewards, DPO on best vs worst"),
    "rm": ("posttrain.trainers.reward_model:RewardModelTrainer",
           "outcome reward model: Bradley-Terry on pairs or binary correctness (scalar head)"),
    "prm": ("posttrain.trainers.prm:PRMTrainer",
            "process reward model: per-step good/bad classifier on step-labelled rows"),
    "ppo": ("posttrain.trainers.ppo:PPOTrainer",
            "PPO with a critic, a frozen reference and rewards or a reward model (RLHF)"),
}


def trainer_class(command: str) -> Any:
    """The trainer class behind a CLI command (e.g. ``"grpo"`` -> ``GRPOTrainer``)."""
    if command not in TRAINERS:
        raise ValueError(f"unknown trainer {command!r}; valid: {sorted(TRAINERS)}")
    module, name = TRAINERS[command][0].split(":")
    return getattr(importlib.import_module(module), name)


def config_class(command: str) -> Any:
    """The config dataclass of a command (``"eval"``: GRPO's, ``"search"``: SearchConfig)."""
    if command == "search":
        from posttrain.config import SearchConfig

        return SearchConfig
    return trainer_class("grpo" if command == "eval" else command).config_class


def train(command: str, cfg: Any) -> dict[str, Any]:
    """Build the trainer for ``command`` from a config and run it; returns the summary."""
    return trainer_class(command)(cfg).train()
