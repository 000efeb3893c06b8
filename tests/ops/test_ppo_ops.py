"""PPO's rank-summed statistics: whitening and explained variance over two "ranks" (each half
of a batch, its moments summed with the other's) equal the one-process value on the whole;
multi-turn episodes: the score, KL and GAE on the model's tokens only."""

from __future__ import annotations

import pytest
import torch

from posttrain.ops import explained_variance, ppo_advantages, token_rewards
from posttrain.ops.masked import as_bool_mask
from tests.ops.oracles import gae_loop


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


# ---- multi-turn episodes: tool answers are holes of response_mask ---------------------------
def test_episode_golden_tool_span_in_the_middle():
    """Model tokens m0 m1, a tool answer t2 t3, model tokens m4 m5, padding. Garbage (9, 7) on
    the tool answer and the padding: the KL, the values and the score never land there.
    beta 0.5, R = 1: rewards m0 -0.05, m1 -0.1, m4 +0.05, m5 -0.15 + 1 = 0.85.
    gamma 0.9, lam 0.5 (gamma*lam 0.45), GAE over m0 m1 m4 m5 with V = 0 after m5:
      m5: delta = 0.85 + 0 - 0.6 = 0.25                       A = 0.25
      m4: delta = 0.05 + 0.9*0.6 - 0.5 = 0.09                 A = 0.09 + 0.45*0.25 = 0.2025
      m1: next is m4 (the tool span passes it through):
          delta = -0.1 + 0.9*0.5 - 0.4 = -0.05                A = -0.05 + 0.45*0.2025 = 0.041125
      m0: delta = -0.05 + 0.9*0.4 - 0.2 = 0.11                A = 0.11 + 0.45*0.041125 = 0.12850625
    returns = A + V: 0.32850625, 0.441125, 0.7025, 0.85; 0 on the tool answer and padding."""
    response = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    kl = torch.tensor([[0.1, 0.2, 9.0, 9.0, -0.1, 0.3, 9.0]])
    values = torch.tensor([[0.2, 0.4, 7.0, 7.0, 0.5, 0.6, 7.0]])
    rewards = token_rewards(torch.tensor([1.0]), response, kl, beta=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0, 0, 0.05, 0.85, 0]]))
    adv, ret = ppo_advantages(rewards, values, response, 0.9, 0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.12850625, 0.041125, 0, 0, 0.2025, 0.25, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.32850625, 0.441125, 0, 0, 0.7025, 0.85, 0]]))


def _episodes(seed: int) -> tuple[torch.Tensor, ...]:
    """6 episodes of up to 12 tokens: model turns and tool spans in random places, right
    padding; scores [6], KL and values [6, 12] with garbage off the model's tokens."""
    g = torch.Generator().manual_seed(seed)
    response = torch.zeros(6, 12, dtype=torch.bool)
    for i in range(6):
        t, model_turn = 0, True
        end = int(torch.randint(4, 13, (1,), generator=g))
        while t < end:
            span = int(torch.randint(1, 4, (1,), generator=g))
            response[i, t:min(t + span, end)] = model_turn
            t, model_turn = t + span, not model_turn
        response[i, 0] = True  # an episode starts with a model turn
    scores = torch.randn(6, generator=g)
    kl = torch.where(response, torch.randn(6, 12, generator=g), 1e6)
    values = torch.where(response, torch.randn(6, 12, generator=g), -1e6)
    return response, scores, kl, values


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's masked entries moved to the front (tool tokens removed), right padded."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        out[i, : int(mask[i].sum())] = x[i][mask[i]]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("whiten", [False, True])
def test_episode_gae_equals_gae_with_the_tool_tokens_removed(seed, whiten):
    """Tool tokens act only by being skipped: per-token rewards and advantages of an episode
    are those of the same episode with its tool tokens cut out (left-aligned), whatever the
    KL and values on the tool tokens; the loop reference agrees on the episode layout."""
    response, scores, kl, values = _episodes(seed)
    rewards = token_rewards(scores, response, kl, beta=0.3)
    adv, ret = ppo_advantages(rewards, values, response, 0.95, 0.9, whiten)
    packed = _compact(response, response)
    p_rewards = token_rewards(scores, packed, _compact(kl, response), beta=0.3)
    p_adv, p_ret = ppo_advantages(p_rewards, _compact(values, response), packed, 0.95, 0.9,
                                  whiten)
    torch.testing.assert_close(_compact(rewards, response), p_rewards)
    torch.testing.assert_close(_compact(adv, response), p_adv)
    torch.testing.assert_close(_compact(ret, response), p_ret)
    assert (adv[~response] == 0).all() and (ret[~response] == 0).all()
    l_adv, l_ret = gae_loop(rewards, values, response, 0.95, 0.9)
    raw, _ = ppo_advantages(rewards, values, response, 0.95, 0.9, whiten=False)
    torch.testing.assert_close(raw, l_adv)
    torch.testing.assert_close(ret, l_ret)
