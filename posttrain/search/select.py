"""Pick one completion out of N: best-of-N, majority vote, score-weighted majority vote.

Every selector returns the *index* of the chosen completion (or None when there is nothing to
choose), so the caller checks correctness and counts tokens the same way for every method.

Final answers are extracted as :func:`posttrain.rewards.math.extract_answer` does (the last
``<answer>`` block, else the last ``\\boxed{}``) and two answers vote together when
:func:`posttrain.rewards.math.math_equal` says they are equal: plain numbers are compared
exactly (``"0.5"`` and ``"0.50"`` are one answer), anything else through math-verify.
A completion without an answer does not vote.

References: best-of-N and majority vote (self-consistency, Wang et al. 2022); PRM-weighted
vote (Uesato et al. 2022; Lightman et al. 2023, "Let's Verify Step by Step"); see
``docs/search.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from posttrain.rewards.errors import UnscorableError
from posttrain.rewards.math import extract_answer, math_equal, plain_number


def answers_of(completions: Sequence[str]) -> list[str | None]:
    """The final answer of each completion (None when it has none)."""
    return [extract_answer(c) for c in completions]


def same_answer(a: str, b: str) -> bool:
    """Mathematical equality of two extracted answers (an unparseable one equals nothing)."""
    try:
        return math_equal(a, b)
    except UnscorableError:
        return False


def group_answers(answers: Sequence[str | None]) -> list[int | None]:
    """A group id per answer: equal answers (``same_answer``) share an id; None stays None.

    Ids are numbered in order of first appearance. Plain numbers are grouped by exact value
    without math-verify; other answers are compared with each group's first member.
    """
    ids: list[int | None] = []
    by_number: dict[object, int] = {}
    reps: list[str] = []  # first member of each group
    for ans in answers:
        if ans is None:
            ids.append(None)
            continue
        num = plain_number(ans)
        if num is not None:
            key = num.normalize()
            if key not in by_number:
                by_number[key] = len(reps)
                reps.append(ans)
            ids.append(by_number[key])
            continue
        match = next((g for g, rep in enumerate(reps)
                      if plain_number(rep) is None and same_answer(rep, ans)), None)
        if match is None:
            match = len(reps)
            reps.append(ans)
        ids.append(match)
    return ids


def best_of_n(scores: Sequence[float]) -> int | None:
    """Index of the highest score (the first on ties); NaN scores never win. None if empty."""
    best, best_score = None, -math.inf
    for i, s in enumerate(scores):
        if not math.isnan(s) and (best is None or s > best_score):
            best, best_score = i, s
    return best


def weighted_vote(answers: Sequence[str | None], weights: Sequence[float]) -> int | None:
    """Score-weighted majority vote: the answer whose completions' weights sum highest.

    Returns the index of that answer's highest-weighted completion. Ties between answers go to
    the answer seen first. Completions without an answer (or with a NaN weight) do not vote.
    With all weights equal to 1 this is the plain majority vote.
    """
    if len(answers) != len(weights):
        raise ValueError(f"{len(answers)} answers but {len(weights)} weights")
    groups = group_answers(answers)
    totals: dict[int, float] = {}
    for g, w in zip(groups, weights, strict=True):
        if g is not None and not math.isnan(w):
            totals[g] = totals.get(g, 0.0) + w
    if not totals:
        return None
    winner = max(totals, key=lambda g: (totals[g], -g))  # ids are in order of appearance
    members = [i for i, g in enumerate(groups) if g == winner and not math.isnan(weights[i])]
    return max(members, key=lambda i: (weights[i], -i))


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """Plain majority vote (self-consistency): the most frequent answer, first seen on ties.

    Returns the index of that answer's first completion; None if no completion has an answer.
    """
    groups = group_answers(answers)
    counts: dict[int, int] = {}
    for g in groups:
        if g is not None:
            counts[g] = counts.get(g, 0) + 1
    if not counts:
        return None
    winner = max(counts, key=lambda g: (counts[g], -g))
    return groups.index(winner)
