"""Trained reward models as search scorers: an ORM as an OutcomeScorer, a PRM as a StepScorer.

Both are the library's one scorer (:mod:`posttrain.models.scorers`: the input format, the
PRM's saved step rule and the aggregation are documented there), here with search's batch size
and, for the ORM, ``probability=True``: its sigmoid P(correct), which is what a weighted vote
should add up.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from posttrain.models.scorers import OutcomeScorer as ORM
from posttrain.models.scorers import ProcessScorer
from posttrain.search.scorers import OutcomeScorer


def _transform(orm: ORM, probability: bool) -> OutcomeScorer:
    return partial(orm.score, transform="sigmoid" if probability else "raw")


def orm_scorer(model: Any, tokenizer: Any, *, batch_size: int = 256,
               probability: bool = True) -> OutcomeScorer:
    """An :class:`OutcomeScorer` from an ORM (``AutoModelForSequenceClassification``, 1 label)."""
    return _transform(ORM(model, tokenizer, batch_size), probability)


def prm_scorer(model: Any, tokenizer: Any, *, batch_size: int = 256) -> ProcessScorer:
    """A step scorer from a PRM (``AutoModelForTokenClassification``, 2 or 3 classes)."""
    return ProcessScorer(model, tokenizer, batch_size)


def load_orm_scorer(path: str | Path, *, batch_size: int = 256, device: Any = "cpu",
                    probability: bool = True, dtype: str = "float32") -> OutcomeScorer:
    """Load an ORM saved by ``posttrain rm`` (checked to be one before loading)."""
    return _transform(ORM.load(path, str(device), dtype, batch_size), probability)


def load_prm_scorer(path: str | Path, *, batch_size: int = 256, device: Any = "cpu",
                    dtype: str = "float32") -> ProcessScorer:
    """Load a PRM saved by ``posttrain prm`` (checked to be one before loading)."""
    return ProcessScorer.load(path, str(device), dtype, batch_size)
