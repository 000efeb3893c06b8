"""Rollout correction (posttrain/ops/importance.py): golden values and properties."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.ops import IS_MODES, policy_loss, rollout_metrics, rollout_weights

# Two sequences, the last slot masked (garbage there on purpose).
OLD = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -7.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, 3.0], [-1.5, -1.5, 0.0]])
MASK = torch.tensor([[True, True, False], [True, True, False]])
# d = old - sampler on real tokens: [[0.5, -1.0], [1.0, 1.0]]
# token ratios r = e^d: [[1.6487213, 0.3678794], [2.7182818, 2.7182818]]
# sequence ratios R = e^(sum d): [e^-0.5, e^2] = [0.6065307, 7.3890561]
R_TOK = [[math.exp(0.5), math.exp(-1.0)], [math.e, math.e]]
R_SEQ = [math.exp(-0.5), math.exp(2.0)]


def _real(x: torch.Tensor) -> list[float]:
    return x[:, :2].flatten().tolist()


@pytest.mark.parametrize("mode,cap,weights,kept", [
    # min(r, 2): the second sequence's tokens (e = 2.718 > 2) are cut to 2
    ("token_truncate", 2.0, [[R_TOK[0][0], R_TOK[0][1]], [2.0, 2.0]], [[1, 1], [1, 1]]),
    # r > 2 leaves the loss: the second sequence's two tokens go, the first keeps its ratios
    ("token_mask", 2.0, [[R_TOK[0][0], R_TOK[0][1]], [0.0, 0.0]], [[1, 1], [0, 0]]),
    # min(R_i, 2) on every token of sequence i: [0.6065, 0.6065], [2, 2]
    ("sequence_truncate", 2.0, [[R_SEQ[0]] * 2, [2.0, 2.0]], [[1, 1], [1, 1]]),
    # R_1 = 7.39 > 2: the whole second sequence leaves the loss
    ("sequence_mask", 2.0, [[R_SEQ[0]] * 2, [0.0, 0.0]], [[1, 1], [0, 0]]),
    # cap 3 keeps e (2.718) in token_mask
    ("token_mask", 3.0, R_TOK, [[1, 1], [1, 1]]),
    ("none", 2.0, [[1.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 1]]),
])
def test_weights_golden(mode, cap, weights, kept):
    w, k = rollout_weights(OLD, SAMPLER, MASK, mode, cap)
    assert _real(w) == pytest.approx([v for row in weights for v in row], rel=1e-6)
    assert k[:, :2].int().tolist() == kept
    assert not k[:, 2].any() and (w[:, 2] == 0).all()  # masked slots: weight 0, never kept
    assert torch.equal(k, w > 0)  # the tokens that count are exactly the positive weights


def test_metrics_golden():
    m = {k: float(v) for k, v in rollout_metrics(OLD, SAMPLER, MASK, "none", 2.0).items()}
    # |d| = 0.5, 1, 1, 1 -> 3.5 / 4
    assert m["rollout/logprob_abs_diff"] == pytest.approx(0.875)
    # k3 of KL(q || pi_old) with d' = q - old = -0.5, 1, -1, -1: e^-d' + d' - 1 =
    # 0.1487213, 0.3678794, 0.7182818, 0.7182818 -> 1.9531644 / 4
    assert m["rollout/k3"] == pytest.approx(0.4882911, rel=1e-6)
    # token ratios 1.6487 + 0.3679 + 2.7183 + 2.7183 = 7.4531643 -> / 4
    assert m["rollout/is_mean"] == pytest.approx(1.8632911, rel=1e-6)
    assert m["rollout/is_clipfrac"] == pytest.approx(0.5)  # two of four above 2
    # ESS = 7.4531643^2 / (4 * (2.7182818 + 0.1353353 + 2 * 7.3890561)) = 55.54966 / 70.52692
    assert m["rollout/ess"] == pytest.approx(0.7876377, rel=1e-6)
    s = {k: float(v) for k, v in rollout_metrics(OLD, SAMPLER, MASK, "sequence_mask",
                                                  2.0).items()}
    # sequence level: R = 0.6065307, 7.3890561 -> mean 3.9977934, one of two above 2,
    # ESS = 7.9955868^2 / (2 * (0.3678794 + 54.5981500)) = 63.92941 / 109.93206
    assert s["rollout/is_mean"] == pytest.approx(3.9977934, rel=1e-6)
    assert s["rollout/is_clipfrac"] == pytest.approx(0.5)
    assert s["rollout/ess"] == pytest.approx(0.5815356, rel=1e-6)
    assert s["rollout/k3"] == m["rollout/k3"]  # token statistics do not depend on the mode


def test_no_gap_means_weight_one_and_zero_metrics():
    w, k = rollout_weights(OLD, OLD.clone(), MASK, "sequence_mask", 1.0)
    assert torch.equal(w, MASK.float()) and torch.equal(k, MASK)
    m = rollout_metrics(OLD, OLD.clone(), MASK, "token_truncate", 1.0)
    assert float(m["rollout/logprob_abs_diff"]) == 0.0 and float(m["rollout/k3"]) == 0.0
    assert float(m["rollout/is_mean"]) == 1.0 and float(m["rollout/ess"]) == 1.0
    assert float(m["rollout/is_clipfrac"]) == 0.0  # r = 1 is not above a cap of 1


@pytest.mark.parametrize("mode", IS_MODES)
def test_masked_positions_have_no_effect(mode):
    g = torch.Generator().manual_seed(0)
    old2, samp2 = OLD.clone(), SAMPLER.clone()
    old2[~MASK] = torch.randn(int((~MASK).sum()), generator=g) * 50
    samp2[~MASK] = torch.randn(int((~MASK).sum()), generator=g) * 50
    w1, k1 = rollout_weights(OLD, SAMPLER, MASK, mode, 2.0)
    w2, k2 = rollout_weights(old2, samp2, MASK, mode, 2.0)
    assert torch.equal(w1, w2) and torch.equal(k1, k2)
    m1, m2 = (rollout_metrics(o, s, MASK, mode, 2.0) for o, s in ((OLD, SAMPLER), (old2, samp2)))
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


def test_sequence_loop_equals_vectorised():
    g = torch.Generator().manual_seed(1)
    old, samp = torch.randn(5, 7, generator=g) * 0.3, torch.randn(5, 7, generator=g) * 0.3
    mask = torch.rand(5, 7, generator=g) > 0.3
    w, _ = rollout_weights(old, samp, mask, "sequence_truncate", 1.2)
    for i in range(5):
        d = sum(float(old[i, t] - samp[i, t]) for t in range(7) if mask[i, t])
        want = min(math.exp(d), 1.2)
        for t in range(7):
            assert float(w[i, t]) == pytest.approx(want if mask[i, t] else 0.0, rel=1e-5)


def test_huge_gap_stays_finite():
    old = torch.tensor([[0.0, 0.0]])
    samp = torch.tensor([[-500.0, -500.0]])  # a ratio of e^1000 before the clamp
    w, _ = rollout_weights(old, samp, torch.ones(1, 2, dtype=torch.bool), "token_mask", 3.0)
    assert torch.isfinite(w).all() and (w == 0).all()
    m = rollout_metrics(old, samp, torch.ones(1, 2, dtype=torch.bool), "sequence_mask", 3.0)
    assert all(torch.isfinite(v) for v in m.values())


def test_bad_mode_and_cap_are_refused():
    with pytest.raises(ValueError, match="rollout_is"):
        rollout_weights(OLD, SAMPLER, MASK, "tokens", 2.0)
    with pytest.raises(ValueError, match="rollout_is_cap"):
        rollout_weights(OLD, SAMPLER, MASK, "token_truncate", 0.0)


def _loss_and_grad(weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 6, generator=g, requires_grad=True)
    lp = torch.nn.functional.logsigmoid(logits)  # [4, 6] any differentiable log-prob
    old = lp.detach() + 0.05 * torch.randn(4, 6, generator=g)
    adv = torch.randn(4, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.2
    loss, _ = policy_loss(lp, old, adv, mask, weights=weights)
    loss.backward()
    return loss.detach(), logits.grad


def test_weights_of_one_are_bit_identical_to_no_correction():
    loss0, grad0 = _loss_and_grad(None)
    loss1, grad1 = _loss_and_grad(torch.ones(4, 6))
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1)


def test_weights_scale_each_tokens_loss():
    loss0, grad0 = _loss_and_grad(None)
    loss2, grad2 = _loss_and_grad(torch.full((4, 6), 2.0))
    assert torch.allclose(loss2, 2 * loss0) and torch.allclose(grad2, 2 * grad0)


@pytest.mark.parametrize("mode", IS_MODES)
def test_nan_sampler_logprob_is_ratio_one(mode):
    """A NaN sampler log-prob on a real token counts as q = pi_old there (ratio 1, as TRL does):
    the weights are those of a sampler equal to the learner on that token, never NaN, and the
    sequence is not rejected for it; `rollout/nan_frac` counts it (1 of 4 real tokens)."""
    nan = SAMPLER.clone()
    nan[0, 1] = float("nan")
    same = SAMPLER.clone()
    same[0, 1] = OLD[0, 1]  # d = 0 on that token
    w, k = rollout_weights(OLD, nan, MASK, mode, 2.0)
    w_same, k_same = rollout_weights(OLD, same, MASK, mode, 2.0)
    assert not w.isnan().any()
    assert torch.equal(w, w_same) and torch.equal(k, k_same)
    m = {k: float(v) for k, v in rollout_metrics(OLD, nan, MASK, mode, 2.0).items()}
    m_same = {k: float(v) for k, v in rollout_metrics(OLD, same, MASK, mode, 2.0).items()}
    assert m.pop("rollout/nan_frac") == 0.25 and m_same.pop("rollout/nan_frac") == 0.0
    assert m == m_same
