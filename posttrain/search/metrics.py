"""Verifier quality on the policy's own samples: ORM pair accuracy and AUC, PRM bad-step F1."""

from __future__ import annotations

from collections.abc import Sequence


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
    """ROC AUC of the scores for correctness, all samples of all problems pooled.

    Mann-Whitney U from average ranks (ties count 1/2), O(n log n); nan without both classes.
    """
    flat = sorted((x, bool(c)) for row_s, row_c in zip(scores, correct, strict=True)
                  for x, c in zip(row_s, row_c, strict=True))
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


def bad_step_f1(step_scores: Sequence[Sequence[float]], labels: Sequence[Sequence[int]],
                threshold: float = 0.5) -> dict[str, float]:
    """F1 of the "bad step" class: a step is predicted bad when P(good) < ``threshold``.

    ``labels`` are 1 / 0 / -1 per step (-1 = bad; a neutral 0 counts as not bad).
    Returns f1, precision, recall, steps and bad_steps.
    """
    tp = fp = fn = steps = 0
    for sc, lab in zip(step_scores, labels, strict=True):
        if len(sc) != len(lab):
            raise ValueError(f"{len(sc)} step scores but {len(lab)} labels")
        for x, y in zip(sc, lab, strict=True):
            pred, bad = x < threshold, y == -1
            tp += pred and bad
            fp += pred and not bad
            fn += bad and not pred
            steps += 1
    precision, recall = tp / max(1, tp + fp), tp / max(1, tp + fn)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"f1": f1, "precision": precision, "recall": recall, "steps": steps,
            "bad_steps": tp + fn}
