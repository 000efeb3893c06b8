"""Process reward model: step classification loss, step scores and their aggregation.

Notation: B solutions, T tokens, C classes (2 or 3), S steps per solution.

Lightman et al. 2023 ("Let's Verify Step by Step", arXiv:2305.20050): at each step separator
(the end of a reasoning step) the model predicts the step's label with cross-entropy. Labels
are 1 (positive), 0 (neutral), -1 (negative). Class layout (our convention): with
``num_classes=3`` the classes are ``0 = negative, 1 = neutral, 2 = positive``; with
``num_classes=2`` they are ``0 = negative, 1 = positive`` and a neutral label counts as
POSITIVE (a valid but unhelpful step should not sink a correct solution). For the same reason
``step_scores_from_logits`` returns P(positive) + P(neutral) for 3 classes unless told
otherwise. A solution's score aggregates its step scores: ``min`` (our default, the weakest
step), ``prod`` (the paper's choice: probability that every step is correct), ``last``, ``mean``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.ops.masked import as_bool_mask, keep, masked_mean

Count = int | float | Tensor | None


def labels_to_classes(labels: Tensor, num_classes: int) -> Tensor:
    """Map step labels {1, 0, -1} to class indices (see the module docstring)."""
    tables = {2: (0, 1, 1), 3: (0, 1, 2)}  # class of label -1, 0, 1
    if num_classes not in tables:
        raise ValueError(f"num_classes must be one of {sorted(tables)}, got {num_classes}")
    lookup = torch.tensor(tables[num_classes], device=labels.device)
    return lookup[(labels.long() + 1).clamp(0, 2)]


def prm_step_loss(
    logits: Tensor,
    labels: Tensor,
    step_mask: Tensor,
    num_classes: int = 2,
    total_steps: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy on step-end positions only.

    Args:
        logits: [B, T, C] class logits at every position (C == num_classes).
        labels: [B, T] step labels in {1, 0, -1} at step ends; anything elsewhere.
        step_mask: [B, T] True at step-end (separator) positions.
        num_classes: 2 (neutral -> positive) or 3.
        total_steps: steps in the whole optimizer step (gradient accumulation); default is
            this batch's count.

    Returns:
        (loss [] mean over steps, metrics) with detached "prm/accuracy" (argmax == label
        class) and "prm/num_steps".
    """
    if logits.shape[-1] != num_classes or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"prm_step_loss: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)}"
            f" plus a class dim of size num_classes={num_classes}"
        )
    mask = as_bool_mask(step_mask)  # [B, T]
    real = labels[mask]
    if bool(((real < -1) | (real > 1)).any()):
        raise ValueError("prm_step_loss: labels at step ends must be 1, 0 or -1")
    classes = keep(labels_to_classes(labels, num_classes), mask)  # [B, T]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, C]
    nll = -logp.gather(-1, classes.unsqueeze(-1)).squeeze(-1)  # [B, T]
    count = mask.sum() if total_steps is None else total_steps
    loss = keep(nll, mask).sum() / count  # []
    with torch.no_grad():
        correct = (logits.argmax(-1) == classes).float()  # [B, T]
        metrics = {"prm/accuracy": masked_mean(correct, mask), "prm/num_steps": mask.sum()}
    return loss, metrics


def step_scores_from_logits(logits: Tensor, neutral_as_positive: bool = True) -> Tensor:
    """P(step is good) from class logits [..., C] -> [...] (C = 2 or 3, fp32).

    For C = 3 this is P(positive) + P(neutral) unless ``neutral_as_positive=False``.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [..., C]
    if probs.shape[-1] == 2:
        return probs[..., 1]
    if probs.shape[-1] == 3:
        return probs[..., 2] + probs[..., 1] if neutral_as_positive else probs[..., 2]
    raise ValueError(f"step_scores_from_logits: expected 2 or 3 classes, got {probs.shape[-1]}")


def _agg_min(scores: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, scores, torch.inf).amin(-1)  # [B]


def _agg_prod(scores: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, scores, 1.0).prod(-1)  # [B]


def _agg_last(scores: Tensor, mask: Tensor) -> Tensor:
    positions = torch.arange(1, scores.shape[-1] + 1, device=scores.device)  # [S]
    last = (mask * positions).amax(-1).clamp(min=1) - 1  # [B]
    return scores.gather(-1, last.unsqueeze(-1)).squeeze(-1)  # [B]


def _agg_mean(scores: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(scores, mask, dim=-1)  # [B]


STEP_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "min": _agg_min,
    "prod": _agg_prod,
    "last": _agg_last,
    "mean": _agg_mean,
}


def aggregate_step_scores(scores: Tensor, step_mask: Tensor, how: str = "min") -> Tensor:
    """One score per solution from its step scores.

    Args:
        scores: [B, S] step scores (probabilities). step_mask: [B, S] True for real steps.
        how: "min" | "prod" | "last" | "mean".

    Returns:
        [B]; a solution with no real step scores 0.
    """
    if how not in STEP_AGGREGATIONS:
        raise ValueError(f"aggregate_step_scores: unknown how {how!r}; "
                         f"valid: {sorted(STEP_AGGREGATIONS)}")
    mask = as_bool_mask(step_mask)  # [B, S]
    out = STEP_AGGREGATIONS[how](scores, mask)  # [B]
    return torch.where(mask.any(-1), out, torch.zeros_like(out))  # [B]
