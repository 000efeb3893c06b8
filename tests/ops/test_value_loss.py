"""Clipped value loss and explained variance (formulas.md section 7)."""

import pytest
import torch

from posttrain.ops import explained_variance, value_loss

# token 0: V 1.5, V_old 1.0, R 2.0 -> V_clip = 1.0 + clip(0.5, +-0.2) = 1.2
#          (V - R)^2 = 0.25, (V_clip - R)^2 = 0.64 -> 0.5 * 0.64 = 0.32 (clipped term wins)
# token 1: V 1.1, V_old 1.0, R 2.0 -> V_clip = 1.1 -> 0.5 * 0.81 = 0.405 (not clipped)
VALUES = torch.tensor([[1.5, 1.1, 1e6]])
OLD = torch.tensor([[1.0, 1.0, -1e6]])
RETURNS = torch.tensor([[2.0, 2.0, 1e6]])
MASK = torch.tensor([[1, 1, 0]], dtype=torch.bool)


def test_value_loss_golden():
    loss, m = value_loss(VALUES, OLD, RETURNS, MASK, clip_eps=0.2)
    # token-mean: (0.32 + 0.405) / 2 = 0.3625
    assert loss.item() == pytest.approx(0.3625, abs=1e-6)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(0.5)
    # values mean over real tokens: (1.5 + 1.1) / 2 = 1.3
    assert m["critic/values_mean"].item() == pytest.approx(1.3)
    # no clipping: 0.5 * (0.25 + 0.81) / 2 = 0.265
    loss, _ = value_loss(VALUES, OLD, RETURNS, MASK, clip_eps=None)
    assert loss.item() == pytest.approx(0.265, abs=1e-6)


def test_value_loss_gradient_and_masking():
    v = VALUES.clone().requires_grad_(True)
    loss, _ = value_loss(v, OLD, RETURNS, MASK, clip_eps=0.2)
    loss.backward()
    # token 0: clipped term is constant in V -> 0 ; token 1: d/dV 0.5*(V-R)^2 / 2 = (1.1-2)/2
    # = -0.45 ; masked token 2: 0 despite its huge values
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -0.45, 0.0]]))


def test_value_loss_unknown_agg():
    with pytest.raises(ValueError, match="token-mean"):
        value_loss(VALUES, OLD, RETURNS, MASK, clip_eps=0.2, loss_agg="mean")


def test_explained_variance_golden():
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # perfect critic -> 1 ; constant critic (mean 2) -> 1 - Var([-1,0,1]) / Var(R) = 0
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    const = torch.full_like(returns, 2.0)
    assert explained_variance(const, returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    # values [1,2,4]: error [0,0,-1], Var = 2/9 ; Var(R) = 2/3 -> 1 - (2/9)/(2/3) = 0.66667
    values = torch.tensor([[1.0, 2.0, 4.0, -9.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(2 / 3, abs=1e-6)
    # Var(R) = 0 -> nan
    assert torch.isnan(explained_variance(const, const, mask))
