"""policy_loss / aggregate_loss: golden values, GSPO, accumulation, masking, gradients."""

import math

import pytest
import torch

from posttrain.ops import aggregate_loss, policy_loss

LN = math.log

# Two sequences, T = 2. Row 0: ratios [1.5, 0.5], A = +1. Row 1: ratio [0.5, pad], A = -1.
LOGP = torch.tensor([[LN(1.5), LN(0.5)], [LN(0.5), 123.0]])
OLD = torch.zeros(2, 2)
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
# per token L = -min(rho*A, clip(rho, 0.8, 1.2)*A):
#   rho 1.5, A +1: -min(1.5, 1.2) = -1.2 (clipped)
#   rho 0.5, A +1: -min(0.5, 0.8) = -0.5
#   rho 0.5, A -1: -min(-0.5, -0.8) = 0.8 (clipped)


def test_token_level_golden_all_aggregations():
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_agg="seq-mean-token-mean")
    # row means: (-1.2 - 0.5)/2 = -0.85 and 0.8 -> (-0.85 + 0.8)/2 = -0.025
    assert loss.item() == pytest.approx(-0.025, abs=1e-6)
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_agg="token-mean")
    # (-1.2 - 0.5 + 0.8) / 3 = -0.3
    assert loss.item() == pytest.approx(-0.3, abs=1e-6)
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_agg="seq-mean-token-sum-norm", max_len=4)
    # -0.9 / (2 sequences * 4) = -0.1125
    assert loss.item() == pytest.approx(-0.1125, abs=1e-6)
    loss, _ = policy_loss(LOGP, OLD, ADV, MASK, loss_agg="seq-mean-token-sum-norm")
    # max_len defaults to T = 2: -0.9 / (2 * 2) = -0.225
    assert loss.item() == pytest.approx(-0.225, abs=1e-6)


def test_token_level_metrics_golden():
    _, m = policy_loss(LOGP, OLD, ADV, MASK)
    # clipped branch active on 2 of 3 real tokens
    assert m["policy/clipfrac"].item() == pytest.approx(2 / 3)
    # approx_kl = mean(old - new) = -(ln1.5 + ln0.5 + ln0.5)/3 = -(0.4055 - 1.3863)/3 = 0.32694
    assert m["policy/approx_kl"].item() == pytest.approx(0.32694, abs=1e-5)
    # ratios 1.5, 0.5, 0.5: mean 0.83333, max 1.5, min 0.5
    assert m["policy/ratio_mean"].item() == pytest.approx(0.83333, abs=1e-5)
    assert m["policy/ratio_max"].item() == pytest.approx(1.5)
    assert m["policy/ratio_min"].item() == pytest.approx(0.5)
    assert all(not v.requires_grad for v in m.values())


def test_clip_higher_dapo():
    # eps_high 0.28: rho 1.5, A +1 -> -min(1.5, 1.28) = -1.28 ; token-mean over that token only
    mask = torch.tensor([[1, 0], [0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(LOGP, OLD, ADV, mask, eps_high=0.28, loss_agg="token-mean")
    assert loss.item() == pytest.approx(-1.28, abs=1e-6)


def test_dual_clip_golden():
    # rho 4, A -1: L = -min(-4, -1.2) = 4 ; dual clip c = 3 caps it at -c*A = 3
    logp = torch.tensor([[LN(4.0)]])
    loss, m = policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]),
                          torch.ones(1, 1), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert m["policy/dual_clipfrac"].item() == 1.0
    loss, _ = policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                    dual_clip=0.5)


def test_gspo_sequence_level_golden():
    # row 0 log-ratios [ln2, 0] -> s = exp(ln2 / 2) = 1.41421 ; A = +1 -> -min(1.414, 1.2) = -1.2
    # row 1 log-ratios [ln0.25, pad] -> s = exp(ln0.25 / 1) = 0.25 ; A = -1 -> -min(-0.25, -0.8)
    #   = 0.8 ; mean over sequences: (-1.2 + 0.8) / 2 = -0.2
    logp = torch.tensor([[LN(2.0), 0.0], [LN(0.25), 55.0]])
    loss, m = policy_loss(logp, OLD, ADV, MASK, ratio_level="sequence")
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    # ratio stats over real tokens of s_i: [1.41421, 1.41421, 0.25]
    assert m["policy/ratio_max"].item() == pytest.approx(2 ** 0.5, abs=1e-6)
    # eps_high 0.5: row 0 -> -min(1.41421, 1.5) = -1.41421 ; (-1.41421 + 0.8)/2 = -0.30711
    loss, _ = policy_loss(logp, OLD, ADV, MASK, ratio_level="sequence", eps_high=0.5)
    assert loss.item() == pytest.approx(-0.30711, abs=1e-5)
    # product form: row 0 s = 2 -> clipped -1.2 ; row 1 s = 0.25 -> 0.8 ; mean -0.2
    loss, _ = policy_loss(logp, OLD, ADV, MASK, ratio_level="sequence",
                          sequence_ratio="product", eps_high=1.5)
    # with eps_high 1.5 row 0 is unclipped: -2 ; (-2 + 0.8)/2 = -0.6
    assert loss.item() == pytest.approx(-0.6, abs=1e-6)


def _random_batch(seed, n=4, t=6, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g) * 2
    old = logp + torch.randn(n, t, generator=g) * 0.15
    mask = torch.rand(n, t, generator=g) > 0.25
    mask[:, 0] = True
    mask[0, :2] = False  # left padding
    mask[0, 2] = True
    adv = torch.randn(n, t if per_token_adv else 1, generator=g).expand(n, t).clone()
    return logp, old, adv, mask


@pytest.mark.parametrize("adv_shape", ["per_sequence", "per_token_constant"])
def test_gspo_token_equals_gspo_for_constant_advantages(adv_shape):
    logp, old, adv, mask = _random_batch(3)
    if adv_shape == "per_sequence":
        adv = adv[:, 0]
    grads = {}
    values = {}
    for level in ("sequence", "sequence_token"):
        x = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(x, old, adv, mask, ratio_level=level, eps_low=0.05, eps_high=0.05)
        loss.backward()
        values[level], grads[level] = loss.detach(), x.grad
    torch.testing.assert_close(values["sequence"], values["sequence_token"])
    torch.testing.assert_close(grads["sequence"], grads["sequence_token"])
    assert grads["sequence"].abs().sum() > 0


def _naive_loss(logp, old, adv, mask, level, eps_low, eps_high):
    """Straight transcription of formulas.md 4-6 (seq-mean-token-mean) for comparison."""
    m = mask.float()
    if level == "token":
        ratio = torch.exp(logp - old)
        a = adv
    else:
        ratio = torch.exp(((logp - old) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True))
        a = adv[:, :1]
    surr = torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    per_token = -surr * torch.ones_like(m)
    return ((per_token * m).sum(1) / m.sum(1)).mean()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradient_matches_naive_reference(level):
    logp, old, adv, mask = _random_batch(5, per_token_adv=(level == "token"))
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(a, old, adv, mask, ratio_level=level, eps_low=0.1, eps_high=0.15)
    ref = _naive_loss(b, old, adv, mask, level, 0.1, 0.15)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad)


def _split_accumulate(logp, old, adv, mask, split, **kw):
    x = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, split), slice(split, None)):
        loss, _ = policy_loss(x[rows], old[rows], adv[rows], mask[rows], **kw)
        loss.backward()
        total = total + loss.detach()
    return total, x.grad


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_gradient_accumulation_equals_one_big_batch(loss_agg, level):
    logp, old, adv, mask = _random_batch(11, n=6, t=7, per_token_adv=True)
    kw = dict(ratio_level=level, loss_agg=loss_agg, max_len=9,
              total_tokens=int(mask.sum()), total_seqs=6)
    x = logp.clone().requires_grad_(True)
    big, _ = policy_loss(x, old, adv, mask, ratio_level=level, loss_agg=loss_agg, max_len=9)
    big.backward()
    total, grad = _split_accumulate(logp, old, adv, mask, split=2, **kw)
    torch.testing.assert_close(total, big.detach())
    torch.testing.assert_close(grad, x.grad)


def test_accumulation_without_totals_differs_for_token_mean():
    # guard that the property above is not trivially true: micro-batch means != big mean
    logp, old, adv, mask = _random_batch(11, n=6, t=7, per_token_adv=True)
    big, _ = policy_loss(logp, old, adv, mask, loss_agg="token-mean")
    total, _ = _split_accumulate(logp, old, adv, mask, split=2, loss_agg="token-mean")
    assert not torch.allclose(total / 2, big)


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"])
def test_masked_slots_have_no_effect(level, loss_agg):
    # [N, T] advantages; at sequence level their masked per-row mean is used
    logp, old, adv, mask = _random_batch(13, per_token_adv=True)
    dirty_logp, dirty_old, dirty_adv = logp.clone(), old.clone(), adv.clone()
    dirty_logp[~mask], dirty_old[~mask], dirty_adv[~mask] = 1e4, -1e4, 1e6
    kw = dict(ratio_level=level, loss_agg=loss_agg, dual_clip=3.0)
    clean = logp.clone().requires_grad_(True)
    dirty = dirty_logp.clone().requires_grad_(True)
    loss_c, m_c = policy_loss(clean, old, adv, mask, **kw)
    loss_d, m_d = policy_loss(dirty, dirty_old, dirty_adv, mask, **kw)
    torch.testing.assert_close(loss_d, loss_c)
    for key in m_c:
        torch.testing.assert_close(m_d[key], m_c[key])
    loss_c.backward()
    loss_d.backward()
    assert torch.isfinite(dirty.grad).all()
    assert (dirty.grad[~mask] == 0).all()
    torch.testing.assert_close(dirty.grad, clean.grad)


def test_fully_padded_row_does_not_count_as_a_sequence():
    logp, old, adv, mask = _random_batch(17, n=3, per_token_adv=True)
    padded_mask = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])
    pad = lambda x: torch.cat([x, torch.full((1, x.shape[1]), 7.0)])  # noqa: E731
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean"):
        a, _ = policy_loss(logp, old, adv, mask, loss_agg=agg)
        b, _ = policy_loss(pad(logp), pad(old), pad(adv), padded_mask, loss_agg=agg)
        torch.testing.assert_close(a, b)


def test_unknown_keys_list_valid_ones():
    args = (LOGP, OLD, ADV, MASK)
    with pytest.raises(ValueError, match=r"\['sequence', 'sequence_token', 'token'\]"):
        policy_loss(*args, ratio_level="seq")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        policy_loss(*args, loss_agg="sum")
    with pytest.raises(ValueError, match=r"\['geometric', 'product'\]"):
        policy_loss(*args, ratio_level="sequence", sequence_ratio="arith")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(torch.zeros(2, 2), MASK, "mean")


def test_aggregate_loss_golden():
    per_token = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # seq-mean-token-mean: (2 + 2)/2 = 2 ; token-mean: (1+3+2+2+2)/5 = 2 ;
    # sum-norm with max_len 5: 10 / (2*5) = 1 ; token-mean with total_tokens=20: 10/20 = 0.5
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx(2.0)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", max_len=5).item() == 1.0
    assert aggregate_loss(per_token, mask, "token-mean", total_tokens=20).item() == 0.5
    # seq-mean-token-mean with total_seqs=8: (2 + 2) / 8 = 0.5
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean", total_seqs=8).item() == 0.5
