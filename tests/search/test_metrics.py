"""Verifier metrics: golden values by hand."""

from __future__ import annotations

import math

import pytest

from posttrain.search.metrics import pair_accuracy, pooled_auc


def test_pair_accuracy_within_problem_only():
    scores = [[0.9, 0.5, 0.5], [0.1, 0.8], [0.3]]
    correct = [[True, False, False], [True, False], [True]]
    # problem 1: 0.9 > 0.5 twice -> 2 hits; problem 2: 0.1 < 0.8 -> 0; problem 3: no pair
    assert pair_accuracy(scores, correct) == pytest.approx(2 / 3)
    assert pair_accuracy([[0.4, 0.4]], [[True, False]]) == 0.5  # tie counts 1/2
    assert math.isnan(pair_accuracy([[0.4]], [[True]]))


def test_pooled_auc_matches_pair_count():
    # positives 0.9, 0.3; negatives 0.5, 0.3: pairs (0.9>0.5) 1, (0.9>0.3) 1, (0.3<0.5) 0,
    # (0.3=0.3) 1/2 -> 2.5 / 4
    assert pooled_auc([[0.9, 0.5], [0.3, 0.3]], [[True, False], [True, False]]) == 0.625
    assert pooled_auc([[1.0, 0.0]], [[True, False]]) == 1.0
    assert math.isnan(pooled_auc([[1.0, 0.0]], [[True, True]]))
