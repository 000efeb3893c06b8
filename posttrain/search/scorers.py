"""Scorer interfaces for test-time search, and adapters between them.

Two small protocols, so any verifier plugs in (a trained ORM or PRM, a rule, a fake in tests):

* :class:`OutcomeScorer`: ``(prompts, completions) -> list[float]``, one score per completion,
  higher = more likely correct (an ORM, or a gold-answer verifier).
* :class:`StepScorer`: ``(prompts, steps) -> list[list[float]]``, batched: for each solution,
  one score per step (the PRM's probability that the step is correct).

A step scorer becomes an outcome scorer with :func:`prm_outcome`, which splits each completion
into its steps (:func:`posttrain.search.select.split_steps`) and aggregates the step scores
(:func:`aggregate_steps`: ``prod`` as in Lightman et al. 2023, or ``min`` / ``last`` / ``mean``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from posttrain.search.select import STEP_SEPARATOR, split_steps


class OutcomeScorer(Protocol):
    def __call__(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[float]: ...


class StepScorer(Protocol):
    def __call__(self, prompts: Sequence[Any], steps: Sequence[Sequence[str]]
                 ) -> list[list[float]]: ...


AGGREGATES: dict[str, Callable[[Sequence[float]], float]] = {
    "prod": lambda s: math.prod(s),
    "min": lambda s: min(s),
    "last": lambda s: s[-1],
    "mean": lambda s: sum(s) / len(s),
}


def aggregate_steps(step_scores: Sequence[float], how: str = "prod",
                    empty: float = 0.0) -> float:
    """One solution score from its step scores; ``empty`` when there are no steps.

    ``prod``: the probability that every step is correct (Lightman et al. 2023, section 2.6);
    ``min``: the weakest step; ``last``: the last step's score; ``mean``: the average.
    A solution that shows no step gets ``empty`` (0.0: an unsupported answer is not trusted).
    """
    if how not in AGGREGATES:
        raise ValueError(f"unknown step aggregation {how!r}; valid: {sorted(AGGREGATES)}")
    return AGGREGATES[how](step_scores) if len(step_scores) else empty


def prm_outcome(step_scorer: StepScorer, aggregate: str = "prod",
                separator: str = STEP_SEPARATOR) -> OutcomeScorer:
    """An outcome scorer from a step scorer: split into steps, score, aggregate."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"unknown step aggregation {aggregate!r}; valid: {sorted(AGGREGATES)}")

    def score(prompts: Sequence[Any], completions: Sequence[str]) -> list[float]:
        steps = [split_steps(c, separator) for c in completions]
        keep = [i for i, s in enumerate(steps) if s]
        out = [aggregate_steps([], aggregate)] * len(completions)
        if keep:
            scored = step_scorer([prompts[i] for i in keep], [steps[i] for i in keep])
            for i, s in zip(keep, scored, strict=True):
                out[i] = aggregate_steps(s, aggregate)
        return out

    return score

