"""Advantage estimators: GAE, group-relative (GRPO outcome / process), RLOO.

Papers: GAE (Schulman et al. 2016), GRPO (Shao et al. 2024, §4.1), RLOO (Ahmadian et al. 2024);
the paper index is docs/algorithms.md.

Notation: B prompts, G samples per prompt (``group_size``), N = B*G sequences, T response
tokens, S steps per completion. Per-sequence rewards are laid out group-contiguous: rows
``0..G-1`` belong to prompt 0, rows ``G..2G-1`` to prompt 1, and so on.

All estimators run under ``torch.no_grad``: advantages and returns are targets, not graph
nodes. Masked slots never feed into a real slot, and every masked slot of an output is 0.
Deliberate choices: GRPO's std is the population std (``std_ddof=0``, seed note 001) unless
``std_ddof=1`` (TRL/verl); a group whose rewards are all equal gets exactly 0 (checked
explicitly, because ``r - mean(r)`` is not always exactly 0 in floating point).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.ops.masked import as_bool_mask, keep


@torch.no_grad()
def gae(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438).

    ``delta[t] = r[t] + gamma * V[next] - V[t]``, ``A[t] = delta[t] + gamma*lam*A[next]``, where
    ``next`` is the next REAL token of the row (padding on either side and holes are skipped)
    and ``V`` after the last real token is 0. ``lam=1`` is Monte Carlo, ``lam=0`` one-step TD.
    The holes of a multi-turn episode are its tool answers: they are not actions, so a tool
    token passes the next value and advantage through unchanged and the result equals GAE on
    the episode with its tool tokens removed (verl's multi-turn GAE does the same).

    Args:
        rewards: [N, T] per-token rewards (e.g. -beta*KL plus the score on the last token).
        values: [N, T] critic values V(s_t).
        response_mask: [N, T] True on real completion tokens.
        gamma: discount. lam: GAE lambda.

    Returns:
        (advantages [N, T], returns [N, T]) with ``returns = advantages + values`` on real
        tokens; both are 0 on masked slots. Whitening is separate: ``masked_whiten``.
    """
    mask = as_bool_mask(response_mask)  # [N, T]
    advantages = torch.zeros_like(values)  # [N, T]
    next_value = values.new_zeros(values.shape[0])  # [N]
    next_adv = values.new_zeros(values.shape[0])  # [N]
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]  # [N]
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        adv_t = delta + gamma * lam * next_adv  # [N]
        advantages[:, t] = keep(adv_t, m)
        next_adv = torch.where(m, adv_t, next_adv)  # [N] carried across masked slots
        next_value = torch.where(m, values[:, t], next_value)  # [N]
    returns = keep(advantages + values, mask)  # [N, T]
    return advantages, returns


@torch.no_grad()
def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D [N] with N divisible by group_size; got shape "
            f"{tuple(rewards.shape)} and group_size={group_size}"
        )
    return rewards.view(-1, group_size)  # [B, G]


def _equal_groups(grouped: Tensor) -> Tensor:
    """[B, 1] True where every reward of the group is equal."""
    return (grouped.amax(-1, keepdim=True) == grouped.amin(-1, keepdim=True))


@torch.no_grad()
def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: str = "group",
    std_ddof: int = 0,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative outcome advantages (GRPO, DeepSeekMath arXiv:2402.03300 section 4.1.2).

    ``A_i = (R_i - mean_G(R)) / (std + eps)``, where std is:
    ``scale="group"`` the group's std; ``"batch"`` the std of all N rewards (TRL's
    ``scale_rewards="batch"``); ``"none"`` no division at all (Dr. GRPO, arXiv:2503.20783).

    Args:
        rewards: [N] scalar rewards, group-contiguous.
        group_size: G.
        std_ddof: 0 = population std (default), 1 = sample std.
        eps: added to the std.

    Returns:
        [N] advantages (broadcast them over tokens). Equal-reward groups give exactly 0.
    """
    grouped = _groups(rewards, group_size)  # [B, G]
    centered = grouped - grouped.mean(-1, keepdim=True)  # [B, G]
    scales: dict[str, Callable[[], Tensor]] = {
        "group": lambda: centered / (grouped.std(-1, correction=std_ddof, keepdim=True) + eps),
        "batch": lambda: centered / (rewards.std(correction=std_ddof) + eps),
        "none": lambda: centered,
    }
    if scale not in scales:
        raise ValueError(f"group_advantages: unknown scale {scale!r}; valid: {sorted(scales)}")
    adv = scales[scale]()  # [B, G]
    adv = torch.where(_equal_groups(grouped), torch.zeros_like(adv), adv)  # [B, G]
    return adv.reshape(-1)  # [N]


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740).

    ``A_i = R_i - (sum_G R - R_i) / (G - 1)``. Needs ``group_size >= 2``.

    Args:
        rewards: [N] group-contiguous. Returns: [N]; equal-reward groups give exactly 0.
    """
    if group_size < 2:
        raise ValueError(f"rloo_advantages needs group_size >= 2, got {group_size}")
    grouped = _groups(rewards, group_size)  # [B, G]
    others = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)  # [B, G]
    adv = grouped - others  # [B, G]
    adv = torch.where(_equal_groups(grouped), torch.zeros_like(adv), adv)  # [B, G]
    return adv.reshape(-1)  # [N]


@torch.no_grad()
def process_advantages(
    step_rewards: Tensor,
    step_mask: Tensor,
    step_end_index: Tensor,
    response_mask: Tensor,
    group_size: int,
    eps: float = 1e-6,
    std_ddof: int = 0,
) -> Tensor:
    """Group-relative process-supervision advantages (DeepSeekMath section 4.1.3).

    Step rewards are normalized over ALL real steps of the group,
    ``r~ = (r - mean) / (std + eps)``, and token ``t`` gets the sum of ``r~`` over the steps
    of its own completion that end at or after ``t``.

    Args:
        step_rewards: [N, S] reward of step j of completion i (e.g. a PRM score).
        step_mask: [N, S] True for real steps (completions have different step counts).
        step_end_index: [N, S] token index in [0, T) of the last token of step j (the
            separator position). Ignored on masked steps.
        response_mask: [N, T] True on real completion tokens.
        group_size: G (rows are group-contiguous).
        std_ddof: 0 = population std over the group's steps (default), 1 = sample std.

    Returns:
        [N, T] token advantages; 0 on masked tokens and after the last step end.
    """
    n, s = step_rewards.shape
    t_len = response_mask.shape[-1]
    smask = as_bool_mask(step_mask)  # [N, S]
    if n % group_size != 0:
        raise ValueError(f"process_advantages: N={n} not divisible by group_size={group_size}")
    ends = torch.where(smask, step_end_index.long(), 0)  # [N, S]
    if bool(((ends < 0) | (ends >= t_len)).any()):
        raise ValueError(f"process_advantages: step_end_index must lie in [0, {t_len}) on steps")
    g_rewards = step_rewards.reshape(-1, group_size * s)  # [B, G*S]
    g_mask = smask.reshape(-1, group_size * s)  # [B, G*S]
    count = g_mask.sum(-1, keepdim=True)  # [B, 1]
    mean = keep(g_rewards, g_mask).sum(-1, keepdim=True) / count.clamp(min=1)  # [B, 1]
    sq = keep((g_rewards - mean) ** 2, g_mask).sum(-1, keepdim=True)  # [B, 1]
    std = (sq / (count - std_ddof).clamp(min=1)).sqrt()  # [B, 1]
    normed = (g_rewards - mean) / (std + eps)  # [B, G*S]
    big, small = torch.finfo(g_rewards.dtype).max, torch.finfo(g_rewards.dtype).min
    hi = torch.where(g_mask, g_rewards, small).amax(-1, keepdim=True)  # [B, 1]
    lo = torch.where(g_mask, g_rewards, big).amin(-1, keepdim=True)  # [B, 1]
    normed = torch.where(hi == lo, torch.zeros_like(normed), normed)  # [B, G*S] equal -> 0
    normed = keep(normed, g_mask).reshape(n, s)  # [N, S]
    at_end = torch.zeros(n, t_len, dtype=normed.dtype, device=normed.device)  # [N, T]
    at_end.scatter_add_(1, ends, normed)  # [N, T] step reward placed on its end token
    suffix = at_end.flip(-1).cumsum(-1).flip(-1)  # [N, T] sum over steps ending at >= t
    return keep(suffix, response_mask)  # [N, T]
