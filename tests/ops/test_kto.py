"""KTO (posttrain.ops.kto): golden values by hand and parity with TRL 1.16's formula."""

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops.kto import kto_loss, kto_reference_point

# logps [-1, -3], ref [-2, -2], beta 0.5: r = 0.5*(+1) = 0.5 (desirable), 0.5*(-1) = -0.5
# (undesirable); z0 = 0.4 -> beta*z0 = 0.2.
# desirable:   1 - sigmoid(0.5 - 0.2) = 1 - 1/(1 + e^-0.3) = 1 - 1/1.740818 = 0.425557
# undesirable: 1 - sigmoid(0.2 + 0.5) = 1 - 1/(1 + e^-0.7) = 1 - 1/1.496585 = 0.331812
LOGPS, REF = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0])
LABELS = torch.tensor([True, False])


def test_kto_golden():
    loss, m = kto_loss(LOGPS, REF, LABELS, 0.4, beta=0.5)
    assert loss.tolist() == pytest.approx([0.425557, 0.331812], abs=1e-6)
    # undesirable_weight 2: 2 * 0.331812 = 0.663624
    loss, _ = kto_loss(LOGPS, REF, LABELS, 0.4, beta=0.5, undesirable_weight=2.0)
    assert loss.tolist() == pytest.approx([0.425557, 0.663624], abs=1e-6)
    # both rows on their side of beta*z0 = 0.2 (0.5 > 0.2, -0.5 < 0.2)
    assert m["rewards/accuracy"].item() == 1.0
    assert m["kto/reference_point"].item() == pytest.approx(0.4)


def test_apo_zero_unpaired_golden():
    # 1 - sigmoid(0.5) = 1 - 0.622459 = 0.377541 ; sigmoid(-0.5) = 0.377541 (z0 unused)
    loss, _ = kto_loss(LOGPS, REF, LABELS, 5.0, beta=0.5, loss_type="apo_zero_unpaired")
    assert loss.tolist() == pytest.approx([0.377541, 0.377541], abs=1e-6)


def test_reference_point_is_the_clamped_detached_mean():
    # (0.5 + 0.3 + 0.4) / 3 = 0.4 ; (-0.3 - 0.3) / 3 = -0.2 -> clamped to 0
    s = torch.tensor(1.2, requires_grad=True)
    z = kto_reference_point(s, 3)
    assert z.item() == pytest.approx(0.4) and not z.requires_grad
    assert kto_reference_point(torch.tensor(-0.6), 3).item() == 0.0


def test_bad_loss_type_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'apo_zero_unpaired', 'kto'"):
        kto_loss(LOGPS, REF, LABELS, 0.0, loss_type="sigmoid")


def _trl_kto(logps, ref, labels, kl_logps, ref_kl_logps, beta, wd, wu, loss_type):
    """TRL 1.16's KTO loss as written in trl/trainer/kto_trainer.py, KTOTrainer._compute_loss
    (read there, re-typed here): kl = mean(KL_logps - ref_KL_logps) detached, clamp(min=0);
    chosen 1 - sigmoid(beta*(logratio - kl)), rejected 1 - sigmoid(beta*(kl - logratio))
    (apo_zero_unpaired: 1 - sigmoid(beta*logratio) / sigmoid(beta*logratio), no kl); the
    weighted losses concatenated, nanmean."""
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    chosen_lr = logps[labels] - ref[labels]
    rejected_lr = logps[~labels] - ref[~labels]
    if loss_type == "kto":
        chosen = 1 - F.sigmoid(beta * (chosen_lr - kl))
        rejected = 1 - F.sigmoid(beta * (kl - rejected_lr))
    else:
        chosen = 1 - F.sigmoid(beta * chosen_lr)
        rejected = F.sigmoid(beta * rejected_lr)
    return torch.cat((wd * chosen, wu * rejected)).nanmean()


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("kl_shift", [0.5, -3.0])  # z0 > 0, and a negative mean clamped to 0
def test_parity_with_trl_value_and_gradient(loss_type, kl_shift):
    g = torch.Generator().manual_seed(0)
    n = 7
    base = torch.randn(n, generator=g, dtype=torch.float64) * 3 - 10
    labels = torch.tensor([True, False, True, True, False, False, True])
    ref = base + torch.randn(n, generator=g, dtype=torch.float64)
    kl_logps = base + torch.randn(n, generator=g, dtype=torch.float64) + kl_shift
    ref_kl = base.clone()
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    want = _trl_kto(a, ref, labels, kl_logps, ref_kl, 0.3, 1.2, 0.7, loss_type)
    z0 = kto_reference_point((kl_logps - ref_kl).sum(), n)
    got, _ = kto_loss(b, ref, labels, z0, beta=0.3, desirable_weight=1.2,
                      undesirable_weight=0.7, loss_type=loss_type)
    got = got.mean()
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
    want.backward()
    got.backward()
    torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)
    assert a.grad.abs().sum() > 0
