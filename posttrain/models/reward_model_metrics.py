"""How good a reward model is: ROC AUC of scores, bad-step metrics of a PRM (no torch).

Used by the held-out evaluation of ``posttrain rm`` / ``posttrain prm`` and by the verifier
measurements of test-time search, so a number means the same in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.data.steps import first_error


def _floats(values: Any) -> list[float]:
    return [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def roc_auc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties count 1/2.

    Args: scores [N] and labels [N] (True = positive), as sequences or tensors.
    Mann-Whitney U from average ranks, O(N log N). Returns nan without both classes.
    """
    flat = sorted(zip(_floats(scores), [bool(v) for v in _floats(labels)], strict=True))
    n_pos = sum(c for _, c in flat)
    n_neg = len(flat) - n_pos
    if not n_pos or not n_neg:
        return float("nan")
    rank_sum, i = 0.0, 0
    while i < len(flat):
        j = i
        while j < len(flat) and flat[j][0] == flat[i][0]:
            j += 1
        rank_sum += (i + 1 + j) / 2 * sum(c for _, c in flat[i:j])  # ranks i+1..j share a mean
        i = j
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def step_metrics(step_scores: Sequence[Sequence[float]], labels: Sequence[Sequence[int]],
                 threshold: float = 0.5, solution_scores: Sequence[float] | None = None
                 ) -> dict[str, float]:
    """Metrics of the "bad step" class: a step is predicted bad when P(good) < ``threshold``.

    ``step_scores`` [R][S_r] and ``labels`` [R][S_r] (1 / 0 / -1; -1 = bad, a neutral 0 counts
    as good). Returns ``step_accuracy``, ``bad_precision``, ``bad_recall``, ``bad_f1``,
    ``first_error_accuracy`` (the first predicted bad step, or none, is the first labelled bad
    one, or none), ``steps``, ``bad_steps`` and, given ``solution_scores`` [R],
    ``solution_auc`` (their ROC AUC against "every step is good").
    """
    tp = fp = fn = correct = total = first_ok = 0
    for scores, lab in zip(step_scores, labels, strict=True):
        if len(scores) != len(lab):
            raise ValueError(f"{len(scores)} step scores but {len(lab)} labels")
        pred = [-1 if s < threshold else 1 for s in scores]
        for p, y in zip(pred, lab, strict=True):
            bad_true, bad_pred = y == -1, p == -1
            tp += bad_true and bad_pred
            fp += bad_pred and not bad_true
            fn += bad_true and not bad_pred
            correct += bad_true == bad_pred
            total += 1
        first_ok += first_error(pred) == first_error(lab)
    precision, recall = tp / max(1, tp + fp), tp / max(1, tp + fn)
    out = {"step_accuracy": correct / max(1, total), "bad_precision": precision,
           "bad_recall": recall,
           "bad_f1": 2 * precision * recall / (precision + recall) if tp else 0.0,
           "first_error_accuracy": first_ok / max(1, len(labels)), "steps": float(total),
           "bad_steps": float(tp + fn)}
    if solution_scores is not None:
        all_good = [all(y != -1 for y in lab) for lab in labels]
        out["solution_auc"] = roc_auc(solution_scores, all_good)
    return out
