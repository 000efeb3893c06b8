"""Masked reductions: golden values and 'masked slots have no effect' properties."""

import pytest
import torch

from posttrain.ops import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([1.0, 2.0, 3.0, 100.0])
M = torch.tensor([1, 1, 1, 0])


def test_masked_sum_and_mean_golden():
    # sum of real slots 1 + 2 + 3 = 6; mean 6 / 3 = 2
    assert masked_sum(X, M).item() == pytest.approx(6.0)
    assert masked_mean(X, M).item() == pytest.approx(2.0)


def test_masked_var_golden():
    # mean 2, squared deviations 1 + 0 + 1 = 2; unbiased 2 / (3 - 1) = 1, biased 2 / 3
    assert masked_var(X, M).item() == pytest.approx(1.0)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(2.0 / 3.0)


def test_masked_whiten_golden():
    # (x - 2) / sqrt(1) = [-1, 0, 1]; the masked slot is 0
    out = masked_whiten(X, M)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    # shift_mean=False adds the mean back: [-1, 0, 1] + 2 = [1, 2, 3]
    out = masked_whiten(X, M, shift_mean=False)
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0, 3.0, 0.0]))


def test_masked_mean_over_dim():
    x = torch.tensor([[1.0, 3.0, 50.0], [4.0, 8.0, 6.0]])
    m = torch.tensor([[True, True, False], [True, True, True]])
    # row 0: (1 + 3) / 2 = 2; row 1: (4 + 8 + 6) / 3 = 6
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([2.0, 6.0]))
    # var per row, unbiased: row 0: (1 + 1) / 1 = 2; row 1: (4 + 4 + 0) / 2 = 4
    torch.testing.assert_close(masked_var(x, m, dim=-1), torch.tensor([2.0, 4.0]))


def test_all_masked_mean_is_zero_not_nan():
    assert masked_mean(X, torch.zeros(4)).item() == 0.0


@pytest.mark.parametrize("garbage", [1e30, float("inf"), float("nan")])
def test_masked_slots_have_no_effect_on_value_or_gradient(garbage):
    for fn in (masked_sum, masked_mean, masked_var, masked_whiten):
        clean = X.clone().requires_grad_(True)
        dirty = X.clone()
        dirty[3] = garbage
        dirty.requires_grad_(True)
        out_c, out_d = fn(clean, M), fn(dirty, M)
        torch.testing.assert_close(out_d, out_c)
        out_c.sum().backward()
        out_d.sum().backward()
        assert dirty.grad[3].item() == 0.0
        torch.testing.assert_close(dirty.grad, clean.grad)
