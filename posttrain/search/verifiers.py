"""Trained reward models as search scorers: an ORM as an OutcomeScorer, a PRM as a StepScorer.

Both are the library's one reward-model path (:mod:`posttrain.models.reward_models`: the input
format, the PRM's saved step rule and the aggregation are documented there), here with search's
batch size and, for the ORM, ``probability=True``: its sigmoid P(correct), which is what a
weighted vote should add up.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttrain.models.reward_models import OutcomeRewardModel, ProcessRewardModel
from posttrain.search.scorers import OutcomeScorer


def load_orm_scorer(path: str | Path, *, batch_size: int = 256, device: Any = "cpu",
                    probability: bool = True, dtype: str = "float32") -> OutcomeScorer:
    """Load an ORM saved by ``posttrain rm`` (checked to be one before loading)."""
    orm = OutcomeRewardModel.load(path, str(device), dtype, batch_size)
    return partial(orm.score, transform="sigmoid" if probability else "raw")


def load_prm_scorer(path: str | Path, *, batch_size: int = 256, device: Any = "cpu",
                    dtype: str = "float32") -> ProcessRewardModel:
    """Load a PRM saved by ``posttrain prm`` (checked to be one before loading)."""
    return ProcessRewardModel.load(path, str(device), dtype, batch_size)
