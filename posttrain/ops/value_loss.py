"""PPO critic loss with value clipping, and explained variance (Schulman et al.
2017; paper index: docs/algorithms.md).

Notation: B prompts, G samples per prompt, N = B*G sequences, T response tokens, V vocab.

``L_V = 0.5 * max((V - R)^2, (V_clip - R)^2)`` with
``V_clip = V_old + clip(V - V_old, -eps_v, eps_v)`` (PPO as in Ziegler et al. 2019 and the
PPO2 baselines). ``clip_eps=None`` turns clipping off (plain ``0.5 * (V - R)^2``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.ops.masked import as_bool_mask, masked_mean, masked_var
from posttrain.ops.policy_loss import Count, aggregate_loss


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_eps: float | None,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    total_tokens: Count = None,
    total_seqs: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss.

    Args:
        values: [N, T] current critic values (requires grad).
        old_values: [N, T] critic values at rollout time.
        returns: [N, T] GAE returns (targets).
        response_mask: [N, T] True on real tokens.
        clip_eps: eps_v of the value clip, or None for no clipping.
        loss_agg, max_len, total_tokens, total_seqs: see ``aggregate_loss`` (default
            token-mean, as PPO averages over all timesteps).

    Returns:
        (loss [], metrics) with detached "critic/vf_clipfrac" (fraction of real tokens where
        the clipped term is the larger one) and "critic/values_mean".
    """
    mask = as_bool_mask(response_mask)  # [N, T]
    unclipped = (values - returns) ** 2  # [N, T]
    if clip_eps is None:
        per_token = 0.5 * unclipped  # [N, T]
        was_clipped = torch.zeros_like(mask)  # [N, T]
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)  # [N, T]
        clipped = (v_clip - returns) ** 2  # [N, T]
        per_token = 0.5 * torch.maximum(unclipped, clipped)  # [N, T]
        was_clipped = clipped > unclipped  # [N, T]
    loss = aggregate_loss(per_token, mask, loss_agg, max_len, total_tokens, total_seqs)
    metrics = {
        "critic/vf_clipfrac": masked_mean(was_clipped.float(), mask).detach(),
        "critic/values_mean": masked_mean(values, mask).detach(),
    }
    return loss, metrics


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor,
                       sum_over_ranks: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over real tokens: 1 is perfect, 0 is a constant guess.

    Args:
        values, returns, response_mask: [N, T]. sum_over_ranks: the all-reduce sum of a float64
        tensor, to take every rank's tokens (from their summed moments). Returns: [] (nan when
        Var(R) is 0).
    """
    if sum_over_ranks is not None:
        m = as_bool_mask(response_mask)
        r, e = returns[m].double(), (returns - values)[m].double()
        s = sum_over_ranks(torch.stack([r.sum(), (r * r).sum(), e.sum(), (e * e).sum(),
                                        r.new_tensor(float(m.sum()))]))  # [5]
        n = s[4].clamp(min=1.0)
        var_r, var_e = s[1] / n - (s[0] / n) ** 2, s[3] / n - (s[2] / n) ** 2  # biased
        return torch.where(var_r > 0, 1.0 - var_e / var_r, torch.full_like(var_r, float("nan")))
    var_returns = masked_var(returns, response_mask, unbiased=False)  # []
    var_error = masked_var(returns - values, response_mask, unbiased=False)  # []
    nan = torch.full_like(var_returns, float("nan"))
    return torch.where(var_returns > 0, 1.0 - var_error / var_returns, nan)
