"""GAE, group-relative (outcome / process) and RLOO advantages (formulas.md section 3)."""

import pytest
import torch

from posttrain.ops import (
    gae,
    group_advantages,
    process_advantages,
    rloo_advantages,
)
from tests.ops.oracles import gae_loop

R3 = torch.tensor([[0.0, 0.0, 1.0]])
V3 = torch.tensor([[0.5, 0.6, 0.7]])
M3 = torch.ones(1, 3, dtype=torch.bool)


def test_gae_golden_monte_carlo():
    # gamma = lam = 1: A[t] = (sum of rewards from t) - V[t] = 1 - V = [0.5, 0.4, 0.3]; R = 1
    adv, ret = gae(R3, V3, M3, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_golden_gamma_lambda():
    # gamma 0.9, lam 0.5 (gamma*lam = 0.45); V after the last token is 0
    # delta2 = 1 + 0.9*0 - 0.7 = 0.3 ; delta1 = 0 + 0.9*0.7 - 0.6 = 0.03
    # delta0 = 0 + 0.9*0.6 - 0.5 = 0.04
    # A2 = 0.3 ; A1 = 0.03 + 0.45*0.3 = 0.165 ; A0 = 0.04 + 0.45*0.165 = 0.11425
    # returns = A + V = [0.61425, 0.765, 1.0]
    adv, ret = gae(R3, V3, M3, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0]]))
    # lam = 0 is one-step TD: A = delta
    adv, _ = gae(R3, V3, M3, gamma=0.9, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.04, 0.03, 0.3]]))


def test_gae_skips_padding_and_holes():
    # same 3 real tokens placed at positions 1, 3, 4 of 6 (left pad, a hole, right pad);
    # the masked slots hold garbage
    rewards = torch.tensor([[1e6, 0.0, -1e6, 0.0, 1.0, 1e6]])
    values = torch.tensor([[1e6, 0.5, 1e6, 0.6, 0.7, -1e6]])
    mask = torch.tensor([[0, 1, 0, 1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.11425, 0.0, 0.165, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.61425, 0.0, 0.765, 1.0, 0.0]]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_vectorized_equals_loop(seed):
    g = torch.Generator().manual_seed(seed)
    n, t = 6, 9
    rewards = torch.randn(n, t, generator=g)
    values = torch.randn(n, t, generator=g)
    mask = torch.rand(n, t, generator=g) > 0.3  # random holes
    mask[0, :3] = False  # left padding
    mask[1, -4:] = False  # right padding
    mask[2] = False  # fully padded row
    rewards[~mask] = 1e8  # garbage must not leak
    values[~mask] = -1e8
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]:
        adv, ret = gae(rewards, values, mask, gamma, lam)
        adv_ref, ret_ref = gae_loop(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(adv, adv_ref)
        torch.testing.assert_close(ret, ret_ref)


def _group_advantages_loop(rewards, group_size, scale, std_ddof, eps):
    out = []
    flat = rewards.tolist()
    for start in range(0, len(flat), group_size):
        grp = flat[start:start + group_size]
        mean = sum(grp) / len(grp)
        if scale == "group":
            denom = (sum((r - mean) ** 2 for r in grp) / (len(grp) - std_ddof)) ** 0.5 + eps
        elif scale == "batch":
            bmean = sum(flat) / len(flat)
            denom = (sum((r - bmean) ** 2 for r in flat) / (len(flat) - std_ddof)) ** 0.5 + eps
        else:
            denom = 1.0
        out += [0.0 if max(grp) == min(grp) else (r - mean) / denom for r in grp]
    return torch.tensor(out)


def test_group_advantages_golden():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25; population std = sqrt((0.5625 + 3*0.0625)/4) = sqrt(0.1875) = 0.43301
    # A = [0.75, -0.25] / 0.43301 = [1.73205, -0.57735]
    torch.testing.assert_close(group_advantages(r, 4, eps=0.0),
                               torch.tensor([1.73205, -0.57735, -0.57735, -0.57735]))
    # ddof=1: std = sqrt(0.75 / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    torch.testing.assert_close(group_advantages(r, 4, std_ddof=1, eps=0.0),
                               torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # none (Dr. GRPO): centered only
    torch.testing.assert_close(group_advantages(r, 4, scale="none"),
                               torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_group_advantages_batch_scale_golden():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # group means 0.25 and 0.5 -> centered [0.75, -0.25 x3] and [0.5, 0.5, -0.5, -0.5]
    # batch mean 3/8; population var = (3*0.625^2 + 5*0.375^2)/8 = 1.875/8 = 0.234375
    # batch std = 0.48412 -> [1.54919, -0.51640 x3], [1.03280 x2, -1.03280 x2]
    want = torch.tensor([1.54919, -0.51640, -0.51640, -0.51640,
                         1.03280, 1.03280, -1.03280, -1.03280])
    torch.testing.assert_close(group_advantages(r, 4, scale="batch", eps=0.0), want)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_reward_group_gives_exact_zero(scale):
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.3])
    adv = group_advantages(r, 3, scale=scale)
    assert (adv[:3] == 0).all()
    assert (adv[3:] != 0).any()
    assert (rloo_advantages(r, 3)[:3] == 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("std_ddof", [0, 1])
def test_group_advantages_vectorized_equals_loop(scale, std_ddof):
    g = torch.Generator().manual_seed(7)
    r = torch.randint(0, 3, (20,), generator=g).double() / 2
    got = group_advantages(r, 5, scale=scale, std_ddof=std_ddof)
    want = _group_advantages_loop(r, 5, scale, std_ddof, 1e-6).double()
    torch.testing.assert_close(got, want)


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"\['batch', 'group', 'none'\]"):
        group_advantages(torch.zeros(4), 2, scale="whiten")


def test_rloo_golden():
    # A_0 = 1 - (0+0+0)/3 = 1 ; A_k = 0 - (1+0+0)/3 = -0.33333
    got = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    torch.testing.assert_close(got, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.zeros(4), 1)


def test_process_advantages_golden():
    # group of 2, T = 5. completion 0: steps rewards [1, 0] ending at tokens 1 and 3, token 4
    # is padding. completion 1: one step reward 1 ending at token 2, all 5 tokens real.
    step_rewards = torch.tensor([[1.0, 0.0], [1.0, 99.0]])
    step_mask = torch.tensor([[1, 1], [1, 0]])
    step_end = torch.tensor([[1, 3], [2, -7]])  # garbage index on the masked step
    response_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # group's step rewards [1, 0, 1]: mean 2/3, std = sqrt((1/9 + 4/9 + 1/9)/3) = 0.47140
    # normalized: 1 -> (1/3)/0.4714 = 0.70711 ; 0 -> -(2/3)/0.4714 = -1.41421
    # completion 0: t=0,1 -> 0.70711 - 1.41421 = -0.70711 ; t=2,3 -> -1.41421 ; t=4 pad -> 0
    # completion 1: t=0..2 -> 0.70711 ; t=3,4 (after the last step end) -> 0
    got = process_advantages(step_rewards, step_mask, step_end, response_mask, 2, eps=0.0)
    want = torch.tensor([[-0.70711, -0.70711, -1.41421, -1.41421, 0.0],
                         [0.70711, 0.70711, 0.70711, 0.0, 0.0]])
    torch.testing.assert_close(got, want)


def test_process_advantages_equal_rewards_and_bad_index():
    step_rewards = torch.full((2, 2), 0.3)
    ones = torch.ones(2, 2)
    ends = torch.tensor([[0, 2], [1, 2]])
    got = process_advantages(step_rewards, ones, ends, torch.ones(2, 3), 2)
    assert (got == 0).all()
    with pytest.raises(ValueError, match="step_end_index"):
        process_advantages(step_rewards, ones, ends + 1, torch.ones(2, 3), 2)
