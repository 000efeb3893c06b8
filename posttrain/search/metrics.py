"""Verifier quality on the policy's own samples: ORM pair accuracy and AUC, PRM step metrics.

ROC AUC and the bad-step metrics are the library's ones
(:mod:`posttrain.models.reward_model_metrics`, also used by ``posttrain rm`` / ``posttrain prm``);
here over [P][N] lists of P problems.
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.models.reward_model_metrics import roc_auc, step_metrics

__all__ = ["pair_accuracy", "pooled_auc", "step_metrics"]


def pair_accuracy(scores: Sequence[Sequence[float]], correct: Sequence[Sequence[bool]]) -> float:
    """P(score of a correct sample > score of a wrong sample of the SAME problem); ties 1/2.

    ``scores`` and ``correct`` are [P][N]; problems with only right or only wrong samples
    contribute no pair. nan when there is no pair at all.
    """
    hits, pairs = 0.0, 0
    for row_s, row_c in zip(scores, correct, strict=True):
        pos = [x for x, c in zip(row_s, row_c, strict=True) if c]
        neg = [x for x, c in zip(row_s, row_c, strict=True) if not c]
        for p in pos:
            for q in neg:
                hits += 1.0 if p > q else 0.5 if p == q else 0.0
                pairs += 1
    return hits / pairs if pairs else float("nan")


def pooled_auc(scores: Sequence[Sequence[float]], correct: Sequence[Sequence[bool]]) -> float:
    """:func:`roc_auc` of the scores for correctness, all samples of all problems pooled."""
    flat = [(x, c) for row_s, row_c in zip(scores, correct, strict=True)
            for x, c in zip(row_s, row_c, strict=True)]
    return roc_auc([x for x, _ in flat], [c for _, c in flat])
