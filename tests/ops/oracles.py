"""Reference implementations for tests: plain Python over each row, slow and obvious."""

from __future__ import annotations

import torch
from torch import Tensor


def gae_loop(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """GAE over each row's real tokens, one at a time: the oracle of `posttrain.ops.gae`."""
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for i in range(values.shape[0]):
        idx = [t for t in range(values.shape[1]) if bool(response_mask[i, t])]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            next_adv = delta + gamma * lam * next_adv
            next_value = float(values[i, t])
            advantages[i, t] = next_adv
            returns[i, t] = next_adv + next_value
    return advantages, returns
