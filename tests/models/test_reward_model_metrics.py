"""The one ROC AUC and the one bad-step metrics (posttrain.models.reward_model_metrics): golden
values by hand, and the brute-force pair count the rank formula must equal."""

from __future__ import annotations

import math
import random

import pytest
import torch

from posttrain.models.reward_model_metrics import roc_auc, step_metrics


def test_roc_auc_golden():
    # positives {0.9, 0.4}, negatives {0.4, 0.1}: pairs (0.9>0.4)=1, (0.9>0.1)=1,
    # (0.4=0.4)=0.5, (0.4>0.1)=1 -> 3.5 / 4 = 0.875
    scores = torch.tensor([0.9, 0.4, 0.4, 0.1])
    labels = torch.tensor([True, True, False, False])
    assert roc_auc(scores, labels) == pytest.approx(0.875)  # tensors (the trainers)
    assert roc_auc([-s for s in scores.tolist()], labels.tolist()) == pytest.approx(0.125)
    assert math.isnan(roc_auc(scores, torch.ones(4, dtype=torch.bool)))
    assert math.isnan(roc_auc([], []))


def test_roc_auc_equals_the_pair_count():
    rng = random.Random(0)
    for _ in range(20):
        scores = [rng.choice([0.1, 0.2, 0.5, 0.7, 0.9]) for _ in range(rng.randint(2, 12))]
        labels = [rng.random() < 0.5 for _ in scores]
        pos = [s for s, y in zip(scores, labels, strict=True) if y]
        neg = [s for s, y in zip(scores, labels, strict=True) if not y]
        if not pos or not neg:
            continue
        pairs = [1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg]
        assert roc_auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))


def test_step_metrics_golden():
    # row 1: labels [1, -1, -1], scores [0.9, 0.2, 0.6] -> predicted bad only step 2:
    #   tp=1 (step 2), fn=1 (step 3); row 2: labels [1, 1], scores [0.7, 0.4] -> fp=1
    # correct steps: 1+1+0 + 1+0 = 3 of 5; precision 1/2, recall 1/2, F1 1/2
    # first error: row 1 predicted 1 == labelled 1; row 2 predicted 1 != labelled 2 (none)
    m = step_metrics([[0.9, 0.2, 0.6], [0.7, 0.4]], [[1, -1, -1], [1, 1]])
    assert m["step_accuracy"] == pytest.approx(3 / 5)
    assert m["bad_precision"] == m["bad_recall"] == m["bad_f1"] == pytest.approx(0.5)
    assert m["first_error_accuracy"] == pytest.approx(0.5)
    assert (m["steps"], m["bad_steps"]) == (5, 2)
    perfect = step_metrics([[0.9, 0.1]], [[0, -1]])  # neutral counts as good
    assert perfect["bad_f1"] == 1.0 and perfect["first_error_accuracy"] == 1.0
    assert step_metrics([[0.5]], [[-1]])["bad_recall"] == 0.0  # P(good) 0.5 is not bad


def test_step_metrics_threshold_and_solution_auc():
    scores = [[0.9, 0.2, 0.1], [0.4, 0.8]]
    labels = [[1, -1, -1], [1, -1]]
    # threshold 0.5 -> predicted bad: 0.2, 0.1, 0.4 -> tp 2, fp 1 (0.4), fn 1 (0.8 is -1)
    got = step_metrics(scores, labels, solution_scores=[0.1, 0.4])
    for key in ("bad_precision", "bad_recall", "bad_f1"):
        assert got[key] == pytest.approx(2 / 3)
    assert math.isnan(got["solution_auc"])  # no all-good solution: one class only
    assert step_metrics(scores, labels, threshold=0.3)["bad_precision"] == 1.0  # 0.4 now good
    auc = step_metrics([[0.9], [0.1]], [[1], [-1]], solution_scores=[0.9, 0.1])["solution_auc"]
    assert auc == 1.0
    with pytest.raises(ValueError, match="2 step scores but 1 labels"):
        step_metrics([[0.1, 0.2]], [[1]])
