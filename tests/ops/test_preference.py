"""DPO variants, Bradley-Terry (formulas.md sections 8-9) and the token-level outcome loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.ops import bradley_terry_loss, dpo_loss, sequence_logprobs, token_outcome_loss
from posttrain.ops.preference import DPO_LOSSES, best_worst_pairs

# chosen -1 vs ref -2, rejected -3 vs ref -2, beta 0.5:
# chosen reward 0.5*(+1) = 0.5, rejected reward 0.5*(-1) = -0.5, h = 1
# -log sigmoid(1) = log(1 + e^-1) = 0.31326 ; -log sigmoid(-1) = log(1 + e) = 1.31326
ARGS = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]))


@pytest.mark.parametrize(
    "loss_type, s, want",
    [
        ("sigmoid", 0.0, 0.31326),
        # 0.9*0.31326 + 0.1*1.31326 = 0.28194 + 0.13133 = 0.41326
        ("cdpo", 0.1, 0.41326),
        ("sigmoid", 0.1, 0.41326),
        # (0.9*0.31326 - 0.1*1.31326) / (1 - 0.2) = (0.28194 - 0.13133)/0.8 = 0.18826
        ("robust", 0.1, 0.18826),
        ("robust", 0.0, 0.31326),
        # (h/beta - 1/(2 beta))^2 = (2 - 1)^2 = 1
        ("ipo", 0.0, 1.0),
        # relu(1 - h) = relu(0) = 0
        ("hinge", 0.0, 0.0),
    ],
)
def test_dpo_golden(loss_type, s, want):
    loss, _ = dpo_loss(*ARGS, beta=0.5, loss_type=loss_type, label_smoothing=s)
    assert loss.shape == (1,)
    assert loss.item() == pytest.approx(want, abs=1e-5)


def test_dpo_hinge_and_ipo_other_beta():
    # beta 0.25: h = 0.5 -> hinge relu(1 - 0.5) = 0.5 ; ipo (0.5/0.25 - 1/0.5)^2 = (2 - 2)^2 = 0
    loss, _ = dpo_loss(*ARGS, beta=0.25, loss_type="hinge")
    assert loss.item() == pytest.approx(0.5)
    loss, _ = dpo_loss(*ARGS, beta=0.25, loss_type="ipo")
    assert loss.item() == pytest.approx(0.0)


def test_dpo_metrics_and_gradient_sign():
    chosen = torch.tensor([-1.0, -5.0], requires_grad=True)
    rejected = torch.tensor([-3.0, -1.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.0])
    loss, m = dpo_loss(chosen, rejected, ref, ref, beta=0.5)
    # chosen rewards [0.5, -1.5] mean -0.5 ; rejected [-0.5, 0.5] mean 0 ;
    # margins [1, -2] mean -0.5 ; accuracy 1/2
    assert m["rewards/chosen"].item() == pytest.approx(-0.5)
    assert m["rewards/rejected"].item() == pytest.approx(0.0)
    assert m["rewards/margin"].item() == pytest.approx(-0.5)
    assert m["rewards/accuracy"].item() == pytest.approx(0.5)
    loss.mean().backward()
    # minimizing the loss raises chosen log-probs and lowers rejected ones
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    # d/dc -log sigmoid(h) = -beta * sigmoid(-h) / B: pair 0: -0.5 * sigmoid(-1) / 2 = -0.06723
    assert chosen.grad[0].item() == pytest.approx(-0.5 * (1 / (1 + math.e)) / 2, abs=1e-6)


def test_dpo_bad_keys():
    with pytest.raises(ValueError, match=r"'cdpo', 'hinge', 'ipo', 'robust', 'sigmoid', 'simpo'"):
        dpo_loss(*ARGS, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*ARGS, loss_type="robust", label_smoothing=0.5)


def test_bradley_terry_golden():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, -1.0])
    # both diffs 1: -log sigmoid(1) = 0.31326
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(0.31326, abs=1e-5)
    # margin 0.5: -log sigmoid(0.5) = log(1 + e^-0.5) = log(1.60653) = 0.47408
    loss = bradley_terry_loss(chosen, rejected, margin=torch.tensor([0.5, 0.5]))
    assert loss.item() == pytest.approx(0.47408, abs=1e-5)


def test_token_outcome_loss_golden():
    # row 0, label 1, completion scores (0, 2): BCE(0 vs 1) = log 2 = 0.693147,
    #   BCE(2 vs 1) = log(1 + e^-2) = 0.126928 -> row mean (0.693147 + 0.126928) / 2 = 0.410038
    # row 1, label 0, one completion score -1: BCE(-1 vs 0) = log(1 + e^-1) = 0.313262
    # mean over rows: (0.410038 + 0.313262) / 2 = 0.361650
    scores = torch.tensor([[5.0, 0.0, 2.0], [-1.0, 7.0, 9.0]])
    mask = torch.tensor([[False, True, True], [True, False, False]])
    loss = token_outcome_loss(scores, torch.tensor([1.0, 0.0]), mask)
    assert loss.item() == pytest.approx(0.361650, abs=1e-5)


def test_token_outcome_loss_masked_positions_have_no_effect():
    torch.manual_seed(0)
    scores = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.4
    mask[:, 0] = True
    labels = torch.tensor([1.0, 0.0, 1.0])
    want = token_outcome_loss(scores, labels, mask)
    junk = scores.clone()
    junk[~mask] = torch.tensor([float("inf"), float("nan"), -1e30]).repeat(15)[:int((~mask).sum())]
    junk.requires_grad_(True)
    got = token_outcome_loss(junk, labels, mask)
    got.backward()
    torch.testing.assert_close(got.detach(), want)
    assert (junk.grad[~mask] == 0).all() and (junk.grad[mask] != 0).all()


def test_token_outcome_loss_one_token_is_plain_bce():
    # only the last position counted: the solution-level binary objective
    scores, labels = torch.tensor([[0.3, -2.0], [1.0, 0.5]]), torch.tensor([0.0, 1.0])
    mask = torch.tensor([[False, True], [False, True]])
    want = torch.nn.functional.binary_cross_entropy_with_logits(scores[:, -1], labels)
    torch.testing.assert_close(token_outcome_loss(scores, labels, mask), want)


def test_dpo_accuracy_counts_margins_within_rounding_as_ties():
    """Before the first update policy == reference: the margin is 0 up to the forward's
    summation order. A margin within beta * 1e-6 * sum|logp| is a tie (wrong); a real one counts.
    Pair 0: logps ~ -50 each, tie band 0.1 * 1e-6 * 200 = 2e-5, margin 0.1 * 1e-5 = 1e-6: a tie.
    Pair 1: margin 0.1 * (1 - 0) = 0.1 >> 2e-5: right."""
    chosen = torch.tensor([-50.0 + 1e-5, -49.0])
    rejected = torch.tensor([-50.0, -50.0])
    ref = torch.tensor([-50.0, -50.0])
    _, m = dpo_loss(chosen, rejected, ref, ref, beta=0.1)
    assert m["rewards/accuracy"].item() == pytest.approx(0.5)
    _, m = dpo_loss(ref, ref, ref, ref, beta=0.1)  # exact ties
    assert m["rewards/accuracy"].item() == 0.0


# SimPO: token-averaged chosen -1, rejected -3, no reference, beta 2, gamma 0.5:
# h = 2 * (-1 - (-3)) = 4 ; h - gamma = 3.5
# -log sigmoid(3.5) = log(1 + e^-3.5) = log(1.030197) = 0.029750
# s = 0.1: 0.9 * 0.029750 + 0.1 * (3.5 + 0.029750) = 0.026775 + 0.352975 = 0.379750
@pytest.mark.parametrize("s, want", [(0.0, 0.029750), (0.1, 0.379750)])
def test_simpo_golden(s, want):
    loss, m = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), None, None, beta=2.0,
                       loss_type="simpo", label_smoothing=s, gamma=0.5)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx(-2.0)  # beta * avg logp, no reference
    assert m["rewards/margin"].item() == pytest.approx(4.0)


def test_registry_declares_what_each_loss_needs():
    assert not DPO_LOSSES["simpo"].reference and DPO_LOSSES["simpo"].average
    assert DPO_LOSSES["ipo"].average and DPO_LOSSES["ipo"].reference
    assert all(DPO_LOSSES[k].reference and not DPO_LOSSES[k].average
               for k in ("sigmoid", "cdpo", "robust", "hinge"))
    with pytest.raises(ValueError, match="reference-free"):
        dpo_loss(*ARGS, loss_type="simpo")  # a reference passed to a reference-free loss
    with pytest.raises(ValueError, match="must be given"):
        dpo_loss(ARGS[0], ARGS[1], None, None, loss_type="sigmoid")
    with pytest.raises(ValueError, match="no target margin"):
        dpo_loss(*ARGS, loss_type="sigmoid", gamma=0.5)


def _trl_simpo(chosen_avg, rejected_avg, beta, gamma, s):
    """TRL 1.16's SimPO loss as written in trl/experimental/cpo/cpo_trainer.py,
    CPOTrainer.cpo_loss (loss_type="simpo", alpha 0; read there, re-typed here), on the
    token-averaged log-probs of CPOTrainer.get_batch_logps(average_log_prob=True):
    logits = (chosen - rejected) - gamma / beta; -(1-s) logsigmoid(beta*logits)
    - s logsigmoid(-beta*logits), mean over the batch (cpo_alpha 0: no NLL term)."""
    logits = (chosen_avg - rejected_avg) - gamma / beta
    losses = (-F.logsigmoid(beta * logits) * (1 - s) - F.logsigmoid(-beta * logits) * s)
    return losses.mean()


@pytest.mark.parametrize("s", [0.0, 0.15])
def test_simpo_parity_with_trl_value_and_gradient(s):
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 5, 9, generator=g, dtype=torch.float64) - 2  # [2 sides, B, T]
    mask = torch.rand(2, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    # TRL's average: (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    trl_avg = (a * mask).sum(-1) / mask.sum(-1)
    want = _trl_simpo(trl_avg[0], trl_avg[1], 2.5, 1.4, s)
    ours = sequence_logprobs(b.flatten(0, 1), mask.flatten(0, 1), average=True).view(2, 5)
    got, _ = dpo_loss(ours[0], ours[1], None, None, beta=2.5, loss_type="simpo",
                      label_smoothing=s, gamma=1.4)
    got = got.mean()
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
    want.backward()
    got.backward()
    torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)
    assert b.grad[~mask].abs().sum() == 0 and b.grad.abs().sum() > 0


def test_best_worst_pairs_golden():
    nan = float("nan")
    # G = 3: group 0 best row 0 (1.0), worst row 1 (0.0); group 1 all 2.0: ties, no pair;
    # group 2 has a NaN: no pair; group 3 best 3.0 at rows 10 and 11 -> the first (10), worst 9
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, nan, 1.0, 0.0, 0.0, 3.0, 3.0])
    chosen, rejected = best_worst_pairs(scores, 3)
    assert chosen.tolist() == [0, 10] and rejected.tolist() == [1, 9]
    chosen, rejected = best_worst_pairs(torch.tensor([2.0, 2.0]), 2)
    assert chosen.numel() == 0 and rejected.numel() == 0


def _trl_online_dpo(logprobs, ref_logprobs, completion_mask, rewards, beta):
    """TRL 1.16's online DPO loss as written in
    trl/experimental/online_dpo/online_dpo_trainer.py, OnlineDPOTrainer.training_step
    (loss_type="sigmoid"; read there, re-typed here): 2 completions per prompt, the first B
    rows the first samples and the next B the second ones; mask = first >= second picks the
    chosen; summed log-probs over the completion mask; -logsigmoid(beta * logits), mean."""
    B = rewards.shape[0] // 2
    first, second = rewards.split(B)
    mask = first >= second
    rng = torch.arange(B)
    chosen_idx = rng + (~mask * B)
    rejected_idx = rng + (mask * B)
    cr = torch.cat((chosen_idx, rejected_idx))
    sums = (logprobs[cr] * completion_mask[cr]).sum(1)
    ref_sums = (ref_logprobs[cr] * completion_mask[cr]).sum(1)
    c, r = sums.split(B)
    rc, rr = ref_sums.split(B)
    logits = (c - r) - (rc - rr)
    return (-F.logsigmoid(beta * logits)).mean()


def test_online_dpo_parity_with_trl_value_and_gradient():
    g = torch.Generator().manual_seed(2)
    B, T = 6, 7
    logp = torch.randn(2 * B, T, generator=g, dtype=torch.float64) - 1  # TRL's layout
    ref = logp.detach() + 0.3 * torch.randn(2 * B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(2 * B, T, generator=g) > 0.2
    rewards = torch.randperm(2 * B, generator=g).double()  # distinct: no ties
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    want = _trl_online_dpo(a, ref, mask, rewards, 0.1)
    # ours: group-contiguous rows (prompt i: its two samples at 2i, 2i+1)
    order = torch.stack([torch.arange(B), torch.arange(B) + B], 1).flatten()  # [2B]
    chosen, rejected = best_worst_pairs(rewards[order], 2)
    seq, ref_seq = sequence_logprobs(b[order], mask[order]), sequence_logprobs(ref[order],
                                                                               mask[order])
    got, _ = dpo_loss(seq[chosen], seq[rejected], ref_seq[chosen], ref_seq[rejected], beta=0.1)
    got = got.mean()
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
    want.backward()
    got.backward()
    torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=0)
