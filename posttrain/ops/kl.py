"""Per-token KL estimators and KL-coefficient controllers.

Papers: Schulman 2020, "Approximating KL divergence" (k1/k2/k3); Ziegler et al. 2019 (adaptive
coefficient); the paper index is docs/algorithms.md.

Notation: B prompts, G samples per prompt, N = B*G sequences, T response tokens, V vocab.

KL(pi_theta || pi_ref) from samples of pi_theta, ``d = logp_theta - logp_ref``: ``k1 = d``
(unbiased, can be negative), ``k2 = d^2 / 2`` (biased, never negative), ``k3 = exp(-d) + d - 1``
(unbiased, never negative; GRPO's). Deliberate: k3 in the paper form, not seed note 000's
upside-down ratio. Two clamps: ``d`` to [-log_ratio_clamp, log_ratio_clamp] (20) before ``exp``;
the per-token estimate to ``[-clamp, clamp]`` (default 10, as OpenRLHF / verl; ``None`` or 0:
off), so one token far below the reference cannot dominate the loss.
More: docs/algorithms.md, "Module notes", posttrain.ops.kl.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _k1(d: Tensor) -> Tensor:
    return d


def _k2(d: Tensor) -> Tensor:
    return 0.5 * d * d


def _k3(d: Tensor) -> Tensor:
    # exp(-d) + d - 1, written with expm1 so small |d| keeps its precision
    return torch.expm1(-d) + d


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kind: str = "k1",
    clamp: float | None = 10.0,
    *,
    log_ratio_clamp: float = 20.0,
) -> Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
        logprobs: [N, T] log pi_theta of the sampled tokens.
        ref_logprobs: [N, T] log pi_ref of the same tokens.
        kind: "k1" | "k2" | "k3" (see the module docstring).
        clamp: bound on the per-token estimate (value ``+-clamp`` and gradient 0 beyond it);
            None or 0 disables it (config key ``kl_clamp``).
        log_ratio_clamp: bound on ``|d|`` applied before ``exp`` (k3 only).

    Returns:
        [N, T] per-token KL. Masked slots are not special-cased: mask in the aggregation.
    """
    estimators: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
    if kind not in estimators:
        raise ValueError(f"kl_penalty: unknown kind {kind!r}; valid kinds: {sorted(estimators)}")
    d = logprobs - ref_logprobs  # [N, T]
    if kind == "k3":
        d = d.clamp(-log_ratio_clamp, log_ratio_clamp)  # [N, T]
    kl = estimators[kind](d)  # [N, T]
    if clamp:
        kl = kl.clamp(-clamp, clamp)  # [N, T]; gradient 0 outside the bound
    return kl


class FixedKLController:
    """A constant KL coefficient ``beta`` (``update`` does nothing)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593, section 2.2).

    ``err = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + err * n_steps / horizon)``
    where ``n_steps`` is the number of samples (episodes) in the batch that produced ``KL``.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController: target and horizon must be > 0, got {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        """Update and return ``beta`` from the batch's mean KL (a float or 0-dim tensor)."""
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value
