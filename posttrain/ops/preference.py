"""Preference and reward-model losses: DPO and variants, SimPO, online DPO's pairs,
Bradley-Terry, token-level outcome BCE (KTO: ``posttrain.ops.kto``).

Notation: B preference pairs (chosen y_w, rejected y_l), T response tokens, V vocab, G samples
per prompt. Margin ``h = beta * [(logp(y_w) - logp_ref(y_w)) - (logp(y_l) - logp_ref(y_l))]``,
``logp(y|x) = sum_t m * logp``. Each ``DPO_LOSSES`` entry declares what it needs
(``PreferenceLoss``: reference, token-averaged log-probs, margin gamma); trainers read these flags
and never branch on the loss name. Losses: ``sigmoid`` ``-log sigmoid(h)``; ``cdpo``
``-(1-s) log sigmoid(h) - s log sigmoid(-h)``; ``robust``
``[-(1-s) log sigmoid(h) + s log sigmoid(-h)] / (1 - 2s)`` (s < 1/2); ``ipo``
``(h/beta - 1/(2*beta))^2`` (averaged); ``hinge`` ``relu(1 - h)``; ``simpo`` reference-free,
averaged, ``cdpo(h - gamma)``. Deliberate: ``sigmoid`` honours ``label_smoothing`` (= ``cdpo``,
as OpenRLHF; TRL 1.16 ignores it). Paper index: docs/algorithms.md.
More: docs/dpo.md, "Module notes", posttrain.ops.preference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def _cdpo(h: Tensor, beta: float, s: float) -> Tensor:
    return -(1.0 - s) * F.logsigmoid(h) - s * F.logsigmoid(-h)  # [B]


def _robust(h: Tensor, beta: float, s: float) -> Tensor:
    if not 0.0 <= s < 0.5:
        raise ValueError(f"dpo_loss(robust): label_smoothing must be in [0, 0.5), got {s}")
    return (-(1.0 - s) * F.logsigmoid(h) + s * F.logsigmoid(-h)) / (1.0 - 2.0 * s)  # [B]


def _ipo(h: Tensor, beta: float, s: float) -> Tensor:
    return (h / beta - 1.0 / (2.0 * beta)) ** 2  # [B]


def _hinge(h: Tensor, beta: float, s: float) -> Tensor:
    return torch.relu(1.0 - h)  # [B]


@dataclass(frozen=True)
class PreferenceLoss:
    """A DPO-family loss ``fn(h - gamma, beta, s) -> [B]`` and what it needs from the caller."""

    fn: Callable[[Tensor, float, float], Tensor]
    reference: bool = True
    """Reference log-probs enter h (False: reference-free, none is loaded or precomputed)."""
    average: bool = False
    """Sequence log-probs are token-averaged (``sequence_logprobs(..., average=True)``)."""
    margin: bool = False
    """The loss takes the target margin gamma."""


DPO_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": PreferenceLoss(_cdpo),
    "cdpo": PreferenceLoss(_cdpo),
    "robust": PreferenceLoss(_robust),
    "ipo": PreferenceLoss(_ipo, average=True),
    "hinge": PreferenceLoss(_hinge),
    "simpo": PreferenceLoss(_cdpo, reference=False, average=True, margin=True),
}


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair DPO-family loss.

    Args:
        chosen_logps / rejected_logps: [B] policy sequence log-probs of y_w / y_l (token
            averages where the loss's ``average`` flag says so).
        ref_chosen_logps / ref_rejected_logps: [B] reference sequence log-probs (these can be
            precomputed once for the whole dataset); None for a reference-free loss (simpo).
        beta: KL strength. loss_type: see the module docstring.
        label_smoothing: s, the assumed label-flip rate (cdpo / robust / sigmoid / simpo).
        gamma: target reward margin subtracted from h (simpo only).

    Returns:
        (loss [B] per pair -- take ``.mean()``, metrics) with detached means
        "rewards/chosen" = beta*(logp - logp_ref)(y_w), "rewards/rejected", "rewards/margin"
        and "rewards/accuracy" (fraction of pairs with chosen reward > rejected reward; a
        margin within float32 rounding of the four log-probs, ``beta * 1e-6 * sum |logp|``, is
        a tie and counts as wrong: before the first update the margin is 0 up to the summation
        order of the forward, which differs with the batch's composition).
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r}; valid: {sorted(DPO_LOSSES)}")
    entry = DPO_LOSSES[loss_type]
    if (ref_chosen_logps is None or ref_rejected_logps is None) == entry.reference:
        raise ValueError(f"dpo_loss({loss_type}): reference log-probs must be "
                         f"{'given' if entry.reference else 'None (reference-free loss)'}")
    if gamma and not entry.margin:
        raise ValueError(f"dpo_loss({loss_type}): takes no target margin gamma, got {gamma}")
    zero = torch.zeros_like(chosen_logps)  # [B] the reference of a reference-free loss
    ref_chosen = zero if ref_chosen_logps is None else ref_chosen_logps  # [B]
    ref_rejected = zero if ref_rejected_logps is None else ref_rejected_logps  # [B]
    chosen_rewards = beta * (chosen_logps - ref_chosen)  # [B]
    rejected_rewards = beta * (rejected_logps - ref_rejected)  # [B]
    h = chosen_rewards - rejected_rewards  # [B]
    loss = entry.fn(h - gamma, beta, label_smoothing)  # [B]
    with torch.no_grad():
        tie = beta * 1e-6 * (chosen_logps.abs() + rejected_logps.abs() + ref_chosen.abs()
                             + ref_rejected.abs())  # [B]
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margin": h.mean(),
            "rewards/accuracy": (h > tie).float().mean(),
        }
    return loss, metrics


def best_worst_pairs(scores: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Online DPO's pairs: the best and the worst of each group of G samples.

    Args:
        scores: [N] sequence scores, N = B*G, group-contiguous; NaN marks an unscorable sample.

    Returns:
        (chosen [P], rejected [P]) row indices into the N samples, one pair per group whose
        scores are all finite and not all equal (a group of ties has no preference: it gives no
        pair, where TRL's online DPO, G = 2, takes the first sample as chosen). Among equal
        best (worst) scores the first sample is taken.
    """
    s = scores.view(-1, group_size)  # [B, G]
    ok = ~s.isnan().any(1)  # [B]
    ok &= s.nan_to_num().amax(1) > s.nan_to_num().amin(1)  # [B] at least two distinct scores
    base = torch.arange(s.shape[0], device=s.device) * group_size  # [B]
    return (base + s.argmax(1))[ok], (base + s.argmin(1))[ok]  # [P], [P]


def bradley_terry_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    margin: Tensor | float | None = None,
) -> Tensor:
    """Bradley-Terry reward-model loss ``mean(-log sigmoid(r_w - r_l - m))``.

    Args:
        chosen_scores / rejected_scores: [B] scalar scores read at the last real token.
        margin: optional [B] (or scalar) margin m subtracted inside the sigmoid
            (the Llama-2 reward-model variant).

    Returns:
        [] mean loss over pairs.
    """
    diff = chosen_scores - rejected_scores  # [B]
    if margin is not None:
        diff = diff - margin  # [B]
    return -F.logsigmoid(diff).mean()  # []


def token_outcome_loss(scores: Tensor, labels: Tensor, response_mask: Tensor) -> Tensor:
    """Token-level outcome (verifier) loss: BCE of ``sigmoid(score_t)`` against the solution's
    label at EVERY completion token, averaged over a row's tokens, then over rows.

    Cobbe et al. 2021 ("Training Verifiers to Solve Math Word Problems", arXiv:2110.14168,
    sec. 4.2): the verifier predicts the final correctness after each token, a value-function-like
    target that they found better and less prone to overfitting than one prediction per solution.

    Args:
        scores: [B, T] logits at every position. labels: [B] 1.0 correct / 0.0 wrong.
        response_mask: [B, T] True on the completion tokens that count (at least one per row).

    Returns:
        [] mean over rows of each row's masked-mean BCE.
    """
    mask = response_mask.bool()  # [B, T]
    target = labels.to(scores.dtype)[:, None].expand_as(scores)  # [B, T]
    safe = torch.where(mask, scores, torch.zeros_like(scores))  # masked: no value, no gradient
    bce = F.binary_cross_entropy_with_logits(safe, target, reduction="none")  # [B, T]
    bce = torch.where(mask, bce, torch.zeros_like(bce))  # [B, T]
    per_row = bce.sum(-1) / mask.sum(-1).clamp(min=1).to(bce.dtype)  # [B]
    return per_row.mean()  # []
