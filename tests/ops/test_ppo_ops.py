"""PPO's rank-summed statistics: whitening and explained variance over two "ranks" (each half
of a batch, its moments summed with the other's) equal the one-process value on the whole."""

from __future__ import annotations

import torch

from posttrain.ops import explained_variance, ppo_advantages
from posttrain.ops.masked import as_bool_mask


def _halves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=g)
    values = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[:, 0] = True
    return rewards, values, mask


def _two_rank_sum(other: torch.Tensor):
    """sum_over_ranks for the first half, whose partner contributes `other`'s moments."""
    return lambda stats: stats + other


def test_explained_variance_from_summed_moments_equals_the_whole_batch():
    _, values, mask = _halves()
    returns = values + 0.3 * torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    whole = explained_variance(values, returns, mask)
    m = as_bool_mask(mask[3:])
    r, e = returns[3:][m].double(), (returns[3:] - values[3:])[m].double()
    other = torch.stack([r.sum(), (r * r).sum(), e.sum(), (e * e).sum(),
                         r.new_tensor(float(m.sum()))])
    split = explained_variance(values[:3], returns[:3], mask[:3], _two_rank_sum(other))
    assert abs(float(split) - float(whole)) < 1e-6
    # one "rank" whose partner has nothing: the same as the plain local value
    zero = torch.zeros(5, dtype=torch.float64)
    local = explained_variance(values[:3], returns[:3], mask[:3], _two_rank_sum(zero))
    assert abs(float(local) - float(explained_variance(values[:3], returns[:3], mask[:3]))) < 1e-6


def test_whitening_over_two_ranks_equals_the_whole_batch():
    rewards, values, mask = _halves()
    whole, _ = ppo_advantages(rewards, values, mask, 0.9, 0.8, whiten=True)
    local_b, _ = ppo_advantages(rewards[3:], values[3:], mask[3:], 0.9, 0.8, whiten=False)
    mb = as_bool_mask(mask[3:])
    other = torch.tensor([float(local_b[mb].sum()), float((local_b[mb].double() ** 2).sum()),
                          float(mb.sum())], dtype=torch.float64)
    split, _ = ppo_advantages(rewards[:3], values[:3], mask[:3], 0.9, 0.8, whiten=True,
                              sum_over_ranks=_two_rank_sum(other))
    assert torch.allclose(split, whole[:3], atol=1e-5)
