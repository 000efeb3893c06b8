"""The training engine every algorithm runs on: the loop (:class:`Trainer`), the one update, the
policy forward, the reference model, checkpoints, FSDP2 and torchrun, the session (data, model,
rewards, evaluation), tracking and the checks made before a model loads.

Algorithms live in :mod:`posttrain.trainers` and subclass :class:`Trainer`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    """``posttrain.engine.Trainer`` without importing the loop for every engine module."""
    if name == "Trainer":
        from posttrain.engine.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'posttrain.engine' has no attribute {name!r}")
