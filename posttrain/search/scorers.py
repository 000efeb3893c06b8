"""Scorer interfaces for test-time search, and the PRM-as-outcome adapter.

Two small protocols, so any verifier plugs in (a trained ORM or PRM, a rule, a fake in tests):

* :class:`OutcomeScorer`: ``(prompts, completions) -> list[float]``, one score per completion,
  higher = more likely correct (an ORM, or a gold-answer verifier).
* :class:`StepScorer`: ``(prompts, steps) -> list[list[float]]``, batched: for each solution,
  one score per step (the PRM's probability that the step is correct).

A trained PRM is the library's one :class:`posttrain.models.reward_models.ProcessRewardModel`; a
step scorer becomes an outcome scorer with :func:`prm_outcome`, which splits, scores and aggregates
exactly as that scorer does (so search ranks by the score a PRM reward would give).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from posttrain.data.steps import THINK, split_steps
from posttrain.models.reward_models import AGGREGATIONS, DEFAULT_AGGREGATE, outcome_from_steps


class OutcomeScorer(Protocol):
    def __call__(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[float]: ...


class StepScorer(Protocol):
    def __call__(self, prompts: Sequence[Any], steps: Sequence[Sequence[str]]
                 ) -> list[list[float]]: ...


def step_splitter(step_scorer: Any) -> Callable[[str], list[str]]:
    """How ``step_scorer`` cuts a completion into steps: a trained PRM's own saved rule (its
    ``split`` method), else the default ``think`` rule of ``posttrain.data.steps``."""
    return getattr(step_scorer, "split", None) or partial(split_steps, rule=THINK)


def prm_outcome(step_scorer: StepScorer, aggregate: str = DEFAULT_AGGREGATE) -> OutcomeScorer:
    """An outcome scorer from a step scorer: split into steps, score, aggregate
    (``posttrain.models.reward_models.outcome_from_steps``; a completion without a step scores
    0)."""
    if aggregate not in AGGREGATIONS:
        raise ValueError(f"aggregate={aggregate!r}; valid: {list(AGGREGATIONS)}")
    split = step_splitter(step_scorer)

    def score(prompts: Sequence[Any], completions: Sequence[str]) -> list[float]:
        return outcome_from_steps(step_scorer, prompts, completions, split, aggregate)

    return score
