"""Process reward model ops: step loss, step scores, aggregation (formulas.md section 9)."""

import math

import pytest
import torch

from posttrain.ops import (
    aggregate_step_scores,
    labels_to_classes,
    prm_step_loss,
    step_scores_from_logits,
)

LN3 = math.log(3.0)


def test_labels_to_classes():
    labels = torch.tensor([-1, 0, 1])
    assert labels_to_classes(labels, 2).tolist() == [0, 1, 1]  # neutral -> positive
    assert labels_to_classes(labels, 3).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        labels_to_classes(labels, 4)


def test_prm_step_loss_two_classes_golden():
    # 4 positions; steps end at 0, 1, 3; position 2 is not a step end (garbage label/logits)
    # logits [0, ln3] -> p = [0.25, 0.75] at every step end
    logits = torch.tensor([[[0.0, LN3], [0.0, LN3], [1e4, -1e4], [0.0, LN3]]],
                          requires_grad=True)
    labels = torch.tensor([[1, -1, -100, 0]])
    step_mask = torch.tensor([[1, 1, 0, 1]])
    loss, m = prm_step_loss(logits, labels, step_mask, num_classes=2)
    # label 1 -> -ln 0.75 = 0.28768 ; label -1 -> -ln 0.25 = 1.38629 ;
    # label 0 (neutral -> positive) -> 0.28768 ; mean (0.28768*2 + 1.38629)/3 = 0.65389
    assert loss.item() == pytest.approx(0.65389, abs=1e-5)
    # argmax is class 1 everywhere: right for labels 1 and 0, wrong for -1 -> 2/3
    assert m["prm/accuracy"].item() == pytest.approx(2 / 3)
    assert m["prm/num_steps"].item() == 3
    loss.backward()
    assert (logits.grad[0, 2] == 0).all()


def test_prm_step_loss_three_classes_golden():
    # logits [0, 0, ln2] -> p = [0.25, 0.25, 0.5]
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)]] * 2])
    labels = torch.tensor([[1, 0]])
    # label 1 -> class 2 -> -ln 0.5 = 0.69315 ; label 0 -> class 1 -> -ln 0.25 = 1.38629
    # mean = 1.03972
    loss, _ = prm_step_loss(logits, labels, torch.ones(1, 2), num_classes=3)
    assert loss.item() == pytest.approx(1.03972, abs=1e-5)


def test_prm_step_loss_bad_input():
    with pytest.raises(ValueError, match="num_classes=3"):
        prm_step_loss(torch.zeros(1, 2, 2), torch.zeros(1, 2), torch.ones(1, 2), num_classes=3)
    with pytest.raises(ValueError, match="1, 0 or -1"):
        prm_step_loss(torch.zeros(1, 2, 2), torch.tensor([[2, 0]]), torch.ones(1, 2))


def test_step_scores_from_logits():
    # 2 classes [0, ln3] -> P(positive) = 0.75
    assert step_scores_from_logits(torch.tensor([0.0, LN3])).item() == pytest.approx(0.75)
    # 3 classes [0, 0, ln2] -> p = [0.25, 0.25, 0.5]: positive+neutral 0.75, positive only 0.5
    three = torch.tensor([0.0, 0.0, math.log(2.0)])
    assert step_scores_from_logits(three).item() == pytest.approx(0.75)
    assert step_scores_from_logits(three, neutral_as_positive=False).item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "how, want",
    [
        ("min", [0.5, 0.6, 0.0]),
        ("prod", [0.36, 0.6, 0.0]),  # 0.9 * 0.5 * 0.8 = 0.36
        ("last", [0.8, 0.6, 0.0]),
        ("mean", [2.2 / 3, 0.6, 0.0]),  # (0.9 + 0.5 + 0.8) / 3 = 0.73333
    ],
)
def test_aggregate_step_scores_golden(how, want):
    scores = torch.tensor([[0.9, 0.5, 0.8, -7.0], [0.6, -7.0, 9.0, 9.0], [3.0, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 2: no steps -> 0
    torch.testing.assert_close(aggregate_step_scores(scores, mask, how), torch.tensor(want))


def test_aggregate_step_scores_unknown():
    with pytest.raises(ValueError, match=r"\['last', 'mean', 'min', 'prod'\]"):
        aggregate_step_scores(torch.zeros(1, 2), torch.ones(1, 2), "max")
