"""Accuracy and token accounting of the search methods on hand-made samples."""

from __future__ import annotations

import pytest

from posttrain.search import build_samples, evaluate_selection, score_samples


def _completion(answer):
    return "<think>x</think>" + ("" if answer is None else f"<answer>{answer}</answer>")


@pytest.fixture()
def samples():
    answers = [["6", "5", "5", "6"], ["3", "3", "2", None]]  # golds 6 and 2
    completions = [[_completion(a) for a in row] for row in answers]
    return build_samples(["A", "B"], ["6", "2"], completions, [[10, 20, 30, 40], [1, 2, 3, 4]])


SCORES = [[0.9, 0.2, 0.3, 0.1], [0.2, 0.2, 0.7, 0.99]]


def test_evaluate_selection_golden(samples):
    assert samples.correct == [[True, False, False, True], [False, False, True, False]]
    r = evaluate_selection(samples, [1, 2, 4], {"orm": SCORES})
    acc = {m: {n: v["accuracy"] for n, v in by_n.items()} for m, by_n in r.items()}
    # n=1: each sample alone: 2/4 + 1/4 correct = 3/8 for every method
    assert {m: a[1] for m, a in acc.items()} == dict.fromkeys(acc, 3 / 8)
    # n=2 groups: A[6,5] A[5,6] B[3,3] B[2,None]
    assert acc["best_of_n:orm"][2] == 1 / 4  # 6 | 5 (0.3>0.1) | 3 | None (0.99)
    assert acc["majority"][2] == 2 / 4  # 6 (tie->first) | 5 | 3 | 2 (None does not vote)
    assert acc["weighted:orm"][2] == 2 / 4  # 6 | 5 | 3 | 2
    assert acc["oracle"][2] == 3 / 4
    # n=4: A: best 6, majority tie -> 6, weighted 6 (1.0 vs 0.5); B: best None, majority 3,
    # weighted 2 (0.7 vs 0.4)
    assert (acc["best_of_n:orm"][4], acc["majority"][4], acc["weighted:orm"][4]) == (
        0.5, 0.5, 1.0)
    assert acc["oracle"][4] == 1.0
    # tokens: mean over trials of the sum over the group
    assert r["majority"][1]["tokens"] == pytest.approx(110 / 8)
    assert r["majority"][2]["tokens"] == pytest.approx((30 + 70 + 3 + 7) / 4)
    assert r["majority"][4]["tokens"] == pytest.approx((100 + 10) / 2)
    assert r["majority"][2]["trials"] == 4


def test_evaluate_selection_rejects_n_not_dividing(samples):
    with pytest.raises(ValueError, match="divide"):
        evaluate_selection(samples, [3], {})


def test_score_samples_batches_and_reshapes(samples):
    seen = []

    def scorer(prompts, completions):
        seen.append(list(prompts))
        return [10.0 * (len(seen) - 1) + i for i in range(len(completions))]

    got = score_samples(samples, scorer, batch_size=3)
    assert seen == [["A", "A", "A"], ["A", "B", "B"], ["B", "B"]]
    assert got == [[0.0, 1.0, 2.0, 10.0], [11.0, 12.0, 20.0, 21.0]]
