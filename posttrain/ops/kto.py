"""KTO: Kahneman-Tversky optimisation on unpaired rows (Ethayarajh et al. 2024, arXiv:2402.01306).

Notation: B unpaired rows ``(x, y, label)``, each desirable (label true) or undesirable. The
implicit reward is ``r = beta * (logp(y|x) - logp_ref(y|x))`` with summed sequence log-probs;
the reference point z0 estimates KL(pi || pi_ref) from mismatched pairs ``(x, y')`` (a prompt
with another row's completion), clamped at 0 and detached.

Deliberate difference from TRL 1.16 (``trl/trainer/kto_trainer.py``, ``KTOTrainer._compute_loss``):
TRL averages the mismatched log-ratios per device micro-batch and then over devices; here z0 is
the mean over the whole optimizer step (every micro-batch and rank), so it does not depend on
the micro-batch size or the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def kto_reference_point(log_ratio_sum: Tensor, count: Tensor | float) -> Tensor:
    """KTO's reference point ``z0 = max(0, sum / count)`` (Ethayarajh et al. 2024, eq. 7).

    Args:
        log_ratio_sum: [] the sum of ``logp(y'|x) - logp_ref(y'|x)`` over the step's mismatched
            pairs (a prompt with another row's completion), over every micro-batch and rank.
        count: how many mismatched pairs the sum is over.

    Returns:
        [] detached: no gradient flows through the reference point (as in the paper and TRL).
    """
    return (torch.as_tensor(log_ratio_sum) / count).clamp(min=0).detach()  # []


def _kto(r: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    return 1 - torch.sigmoid(r - z), 1 - torch.sigmoid(z - r)  # [B], [B]


def _apo_zero(r: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    return 1 - torch.sigmoid(r), torch.sigmoid(r)  # [B], [B]


KTO_LOSSES: dict[str, tuple[Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], bool]] = {
    "kto": (_kto, True),  # (losses of desirable / undesirable rows, needs the reference point)
    "apo_zero_unpaired": (_apo_zero, False),  # APO-zero, D'Oosterlinck et al. 2024, unpaired
}


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    z0: Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-row KTO loss on unpaired rows (Ethayarajh et al. 2024, arXiv:2402.01306, eq. 7).

    With the implicit reward ``r = beta * (logp(y|x) - logp_ref(y|x))``: a desirable row costs
    ``w_D * (1 - sigmoid(r - beta*z0))``, an undesirable one ``w_U * (1 - sigmoid(beta*z0 - r))``
    (``apo_zero_unpaired``: ``1 - sigmoid(r)`` and ``sigmoid(r)``, no reference point).

    Args:
        logps / ref_logps: [B] summed sequence log-probs of the policy / the reference.
        desirable: [B] bool, the row's label. z0: [] the reference point
            (``kto_reference_point``). beta, desirable_weight, undesirable_weight: as in the
            paper (lambda_D, lambda_U).

    Returns:
        (loss [B] per row -- take the mean over rows, metrics) with detached
        "rewards/accuracy" (fraction of rows on their side of the reference point: desirable
        r > beta*z0, undesirable r < beta*z0; a difference within float32 rounding of the log-probs
        is a tie and counts as wrong, as in ``dpo_loss``) and "kto/reference_point".
    """
    if loss_type not in KTO_LOSSES:
        raise ValueError(f"kto_loss: unknown loss_type {loss_type!r}; valid: {sorted(KTO_LOSSES)}")
    r = beta * (logps - ref_logps)  # [B]
    z = beta * torch.as_tensor(z0, dtype=r.dtype, device=r.device)  # []
    good, bad = KTO_LOSSES[loss_type][0](r, z)  # [B], [B]
    loss = torch.where(desirable, desirable_weight * good, undesirable_weight * bad)  # [B]
    with torch.no_grad():
        tie = beta * 1e-6 * (logps.abs() + ref_logps.abs())  # [B] float32 rounding of r
        right = torch.where(desirable, r - z > tie, z - r > tie)  # [B]
        metrics = {"rewards/accuracy": right.float().mean(), "kto/reference_point": z / beta}
    return loss, metrics
