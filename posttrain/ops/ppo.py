"""PPO's per-token rewards and advantages (formulas §4): the score on the last real token plus
``-beta * KL`` on every token, then GAE with optional whitening over every rank's tokens.
"Real" tokens are the model's (`response_mask`): in a multi-turn episode the tool answers are
holes, so the score sits on the last MODEL token and GAE skips the tool spans.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.ops.advantages import gae
from posttrain.ops.masked import as_bool_mask, keep, masked_whiten

SumFn = Callable[[Tensor], Tensor]
"""The sum of a tensor over every rank (torchrun's all-reduce); identity on one process."""


def last_token_index(response_mask: Tensor) -> Tensor:
    """[N] index of each row's last real completion token (the mask may have holes)."""
    mask = as_bool_mask(response_mask)  # [N, T]
    if not bool(mask.any(-1).all()):
        raise ValueError("every completion needs at least one real token to carry its score")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)  # [N, T]
    return torch.where(mask, positions, -1).amax(-1)  # [N]


def token_rewards(scores: Tensor, response_mask: Tensor, kl: Tensor | None = None,
                  beta: float = 0.0) -> Tensor:
    """Per-token PPO rewards: ``-beta * kl[t]`` on real tokens plus the score on the last one.

    Args:
        scores: [N] sequence scores R. response_mask: [N, T]. kl: [N, T] per-token KL estimate
        (or None). beta: KL coefficient.
    Returns:
        [N, T] rewards, 0 on masked slots.
    """
    mask = as_bool_mask(response_mask)
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [N, T]
    if kl is not None and beta != 0.0:
        rewards = keep(-beta * kl.float(), mask)  # [N, T]
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards)
    return rewards


def ppo_advantages(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float,
                   lam: float, whiten: bool,
                   sum_over_ranks: SumFn | None = None) -> tuple[Tensor, Tensor]:
    """GAE (``posttrain.ops.gae``, V = 0 past the last token), then optional whitening with
    the mean and (unbiased) variance over every rank's real tokens (`sum_over_ranks`: the
    all-reduce sum of a float64 tensor; this process's tokens alone without it).

    Returns (advantages [N, T], returns [N, T]); returns are never whitened (critic targets).
    """
    advantages, returns = gae(rewards, values, response_mask, gamma, lam)
    if not whiten:
        return advantages, returns
    if sum_over_ranks is None:
        return masked_whiten(advantages, response_mask), returns
    m = as_bool_mask(response_mask)
    stats = torch.tensor([float(advantages[m].sum()), float((advantages[m].double() ** 2).sum()),
                          float(m.sum())], dtype=torch.float64)
    s, sq, n = sum_over_ranks(stats).tolist()
    mean = s / max(n, 1.0)
    var = (sq - n * mean * mean) / max(n - 1.0, 1.0)
    return keep((advantages - mean) * (var + 1e-8) ** -0.5, m), returns
