"""Trainers: one shared loop (:mod:`posttrain.trainers.base`), one thin subclass per algorithm.

``TRAINERS`` maps each CLI command to its trainer class (imported lazily, so ``posttrain --help``
stays fast) and a one-line description; a new trainer adds one line here and its config one line
in ``posttrain.config.CONFIGS``.
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
            "DPO / cDPO / robust DPO / IPO / hinge on preference pairs (no reward model)"),
    "rm": ("posttrain.trainers.reward_model:RewardModelTrainer",
           "outcome reward model: Bradley-Terry on pairs or binary correctness (scalar head)"),
    "prm": ("posttrain.trainers.prm:PRMTrainer",
            "process reward model: per-step good/bad classifier on step-labelled rows"),
}


def trainer_class(command: str) -> Any:
    """The trainer class behind a CLI command (e.g. ``"grpo"`` -> ``GRPOTrainer``)."""
    if command not in TRAINERS:
        raise ValueError(f"unknown trainer {command!r}; valid: {sorted(TRAINERS)}")
    module, name = TRAINERS[command][0].split(":")
    return getattr(importlib.import_module(module), name)


def train(command: str, cfg: Any) -> dict[str, Any]:
    """Build the trainer for ``command`` from a config and run it; returns the summary."""
    return trainer_class(command)(cfg).train()
