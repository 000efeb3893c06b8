"""DPO variants, Bradley-Terry (formulas.md sections 8-9) and the token-level outcome loss."""

import math

import pytest
import torch

from posttrain.ops import bradley_terry_loss, dpo_loss, token_outcome_loss

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
    with pytest.raises(ValueError, match=r"'cdpo', 'hinge', 'ipo', 'robust', 'sigmoid'"):
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
