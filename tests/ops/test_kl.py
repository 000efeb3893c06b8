"""KL estimators and KL controllers (formulas.md sections 1-2)."""

import math

import pytest
import torch

from posttrain.ops import AdaptiveKLController, FixedKLController, kl_penalty

LN2 = math.log(2.0)


def test_estimators_golden_at_d_ln2():
    logp = torch.tensor([[LN2, -LN2]])
    ref = torch.zeros(1, 2)
    # k1 = d = +-0.6931
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[LN2, -LN2]]))
    # k2 = d^2 / 2 = 0.48045 / 2 = 0.24023 for both signs
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.24023, 0.24023]]),
                               atol=1e-5, rtol=0)
    # k3(d = ln2)  = exp(-ln2) + ln2 - 1 = 0.5 + 0.6931 - 1 = 0.1931
    # k3(d = -ln2) = exp(ln2) - ln2 - 1 = 2 - 0.6931 - 1 = 0.3069
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[0.19315, 0.30685]]),
                               atol=1e-5, rtol=0)


def test_k3_is_never_negative():
    torch.manual_seed(0)
    d = torch.cat([torch.randn(10_000) * 5, torch.randn(10_000) * 1e-4, torch.zeros(3)])
    assert (kl_penalty(d, torch.zeros_like(d), "k3") >= 0).all()


def test_k3_clamps_before_exp():
    # d = -1000 clamped to -20: exp(20) - 20 - 1 = 4.8517e8 - 21 (finite); d = +1000 -> 19 + e^-20
    # (the estimate clamp is off here, so the log-ratio clamp alone is visible)
    out = kl_penalty(torch.tensor([-1000.0, 1000.0]), torch.zeros(2), "k3", clamp=None)
    assert torch.isfinite(out).all()
    assert out[0].item() == pytest.approx(math.exp(20) - 21, rel=1e-5)
    assert out[1].item() == pytest.approx(19.0, abs=1e-6)


def test_k1_and_k3_are_unbiased_and_seed_form_is_not():
    # E_{x~p}[k(x)] over a whole categorical distribution, computed exactly.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum()
    for kind in ("k1", "k3"):
        est = (p * kl_penalty(p.log(), q.log(), kind)).sum()
        torch.testing.assert_close(est, true_kl)
    ratio = p / q  # the seed note's upside-down k3: pi_theta/pi_ref - log(.) - 1
    seed_form = (p * (ratio - ratio.log() - 1)).sum()
    assert abs(seed_form - true_kl) > 0.05


def test_unknown_kind_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'k1', 'k2', 'k3'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_gradient_of_k3():
    # dk3/dd = 1 - exp(-d); at d = ln2: 1 - 0.5 = 0.5
    logp = torch.tensor([LN2], requires_grad=True)
    kl_penalty(logp, torch.zeros(1), "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(0.5, abs=1e-6)


def _value_and_grad(d: list[float], kind: str, **kw) -> tuple[list[float], list[float]]:
    logp = torch.tensor(d, requires_grad=True)
    kl = kl_penalty(logp, torch.zeros(len(d)), kind, **kw)
    kl.sum().backward()
    return kl.tolist(), logp.grad.tolist()


def test_k3_estimate_clamped_at_10_by_default():
    # d = -3: k3 = exp(3) - 3 - 1 = 20.0855 - 4 = 16.0855 -> clamped to 10, gradient 0
    # d = -2: k3 = exp(2) - 2 - 1 = 7.3891 - 3 = 4.3891 (inside), dk3/dd = 1 - exp(2) = -6.3891
    # d = +3: k3 = exp(-3) + 3 - 1 = 0.0498 + 2 = 2.0498 (inside), dk3/dd = 1 - 0.0498 = 0.9502
    values, grads = _value_and_grad([-3.0, -2.0, 3.0], "k3")
    assert values == pytest.approx([10.0, 4.38906, 2.04979], abs=1e-4)
    assert grads == pytest.approx([0.0, -6.38906, 0.95021], abs=1e-4)


def test_k3_unclamped_when_clamp_off():
    # d = -3 without the estimate clamp: 16.0855 with gradient 1 - exp(3) = -19.0855
    for off in (None, 0):
        values, grads = _value_and_grad([-3.0], "k3", clamp=off)
        assert values == pytest.approx([16.08554], abs=1e-4)
        assert grads == pytest.approx([-19.08554], abs=1e-4)


def test_k1_k2_estimates_clamped():
    # k1 = d: d = -12 -> -10 (grad 0), d = 11 -> 10 (grad 0), d = 5 -> 5 (grad 1)
    values, grads = _value_and_grad([-12.0, 11.0, 5.0], "k1")
    assert values == [-10.0, 10.0, 5.0] and grads == [0.0, 0.0, 1.0]
    # k2 = d^2/2: d = 5 -> 12.5 -> 10 (grad 0); d = 4 -> 8 (grad d = 4); d = -4.5 -> 10.125 -> 10
    values, grads = _value_and_grad([5.0, 4.0, -4.5], "k2")
    assert values == [10.0, 8.0, 10.0] and grads == [0.0, 4.0, 0.0]
    # a custom bound: k1 with clamp=2 at d = 3 -> 2 (grad 0)
    values, grads = _value_and_grad([3.0], "k1", clamp=2.0)
    assert values == [2.0] and grads == [0.0]


def test_adaptive_controller_golden():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10_000)
    # KL 9: err = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; beta = 0.2 * (1 + 0.2*256/1e4) = 0.201024
    assert ctl.update(9.0, n_steps=256) == pytest.approx(0.201024)
    assert ctl.value == pytest.approx(0.201024)
    ctl = AdaptiveKLController(0.2, 6.0, 10_000)
    # KL 3: err = clip(-0.5) = -0.2; beta = 0.2 * (1 - 0.00512) = 0.198976
    ctl.update(torch.tensor(3.0), n_steps=256)
    assert ctl.value == pytest.approx(0.198976)
    ctl = AdaptiveKLController(0.2, 6.0, 10_000)
    # KL 6.6: err = 0.1 (inside the clip); beta = 0.2 * (1 + 0.1*256/1e4) = 0.200512
    ctl.update(6.6, n_steps=256)
    assert ctl.value == pytest.approx(0.200512)


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    assert ctl.update(100.0, 64) == 0.05 and ctl.value == 0.05
