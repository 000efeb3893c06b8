"""Selection rules of test-time search: golden cases computed by hand."""

from __future__ import annotations

import math

import pytest

from posttrain.search import (
    aggregate_scores,
    best_of_n,
    group_answers,
    majority_vote,
    prm_outcome,
    weighted_vote,
)


def test_group_answers_uses_math_equivalence():
    # "0.5" == "0.50" and "1,000" == "1000" (exact Decimal); None never groups
    assert group_answers(["0.5", "7", "0.50", None, "1,000", "1000", "7.0"]) == [
        0, 1, 0, None, 2, 2, 1]


def test_best_of_n_argmax_first_on_ties_and_skips_nan():
    assert best_of_n([0.1, 0.9, 0.9, 0.3]) == 1
    assert best_of_n([math.nan, 0.2, 0.1]) == 1
    assert best_of_n([]) is None
    assert best_of_n([math.nan]) is None


def test_majority_vote_most_frequent_first_seen_on_ties():
    assert majority_vote(["3", "5", "5", "3", "5"]) == 1  # "5" x3 beats "3" x2
    assert majority_vote(["3", "5"]) == 0  # tie -> first seen
    assert majority_vote([None, None, "4"]) == 2  # no-answer completions do not vote
    assert majority_vote([None]) is None


def test_weighted_vote_picks_heaviest_not_most_frequent():
    answers = ["3", "3", "3", "5"]
    weights = [0.1, 0.1, 0.1, 0.9]  # "3": 0.1*3 = 0.3 < "5": 0.9
    assert majority_vote(answers) == 0
    assert weighted_vote(answers, weights) == 3
    # "3": 0.4+0.4+0.4 = 1.2 > "5": 0.9 -> "3", its heaviest member (first on ties)
    assert weighted_vote(answers, [0.4, 0.4, 0.4, 0.9]) == 0
    # equivalent answers pool their weight: "2" 0.3 + "2.0" 0.3 = 0.6 > "9" 0.5
    assert weighted_vote(["2", "9", "2.0"], [0.3, 0.5, 0.3]) == 0


def test_weighted_vote_with_unit_weights_is_majority():
    answers = ["1", "2", "2", None, "1", "2"]
    assert weighted_vote(answers, [1.0] * 6) == majority_vote(answers) == 1


def test_weighted_vote_errors_and_empty():
    with pytest.raises(ValueError, match="3 answers but 2 weights"):
        weighted_vote(["1", "2", "3"], [1.0, 1.0])
    assert weighted_vote([None, None], [1.0, 1.0]) is None


def test_aggregate_scores_golden():
    s = [0.5, 0.8]
    assert aggregate_scores([s], "prod") == pytest.approx([0.4])  # 0.5 * 0.8
    assert aggregate_scores([s], "min") == [0.5]
    assert aggregate_scores([s], "last") == pytest.approx([0.8])
    assert aggregate_scores([s], "mean") == pytest.approx([0.65])  # (0.5 + 0.8) / 2
    assert aggregate_scores([s, []], "prod") == pytest.approx([0.4, 0.0])  # no steps: 0
    assert aggregate_scores([s]) == [0.5]  # the one default: min
    with pytest.raises(ValueError, match="valid"):
        aggregate_scores([s], "max")


def test_prm_outcome_splits_scores_and_aggregates():
    calls = []

    def step_scorer(prompts, steps):
        calls.append((list(prompts), [list(s) for s in steps]))
        return [[0.9 if "=" in x else 0.2 for x in row] for row in steps]

    score = prm_outcome(step_scorer, "prod")
    got = score(["p1", "p2", "p3", "p4"], ["<think>1+1=2; 2*3=6</think>",
                                           " ",  # no step: 0.0, not sent to the scorer
                                           "<think>1+1=2; oops</think>",
                                           "6"])  # no block: one step, its whole text
    assert got == pytest.approx([0.81, 0.0, 0.18, 0.2])  # 0.9*0.9, -, 0.9*0.2, 0.2
    assert calls == [(["p1", "p3", "p4"], [["1+1=2", "2*3=6"], ["1+1=2", "oops"], ["6"]])]


def test_prm_outcome_uses_the_scorers_own_split_rule():
    class LineScorer:  # like a trained PRM whose saved rule is one step per line
        def split(self, completion):
            return [x for x in completion.split("\n") if x]

        def __call__(self, prompts, steps):
            return [[0.5] * len(row) for row in steps]

    got = prm_outcome(LineScorer(), "prod")(["p"], ["<think>a; b; c</think>\nd"])
    assert got == pytest.approx([0.25])  # two lines, not four think steps
