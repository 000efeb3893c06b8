"""`micro_batch_size: 1` gives the same update as one micro-batch of the whole step.

For every registered trainer: the gradient that reaches the first optimizer step (every
optimizer group's) and the step's losses are the same whether the step's rows go through the
model one at a time (a DPO pair, two sequences, is its smallest unit) or all at once, because
every micro-batch's loss is divided by the whole optimizer step's normalisers.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.core.padding import PAD_COUNT
from posttrain.engine import update
from posttrain.trainers import trainer_class
from tests.conformance.conftest import CASES, build, case_keys, command_of

BUDGETED = [c for c in CASES if getattr(trainer_class(command_of(c)), "supports_token_budget",
                                        False)]
AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


def _first_step(world, tmp_path, case, micro: int, monkeypatch, **extra) -> tuple[list, dict]:
    out = tmp_path / f"{micro}_{len(extra)}"
    trainer = build(case, case_keys(world, case, out, max_steps=1, save_every=0,
                                    micro_batch_size=micro, **extra))
    seen: list[list[torch.Tensor]] = []
    step_groups = update.step_groups

    def recording(groups, dist):  # noqa: ANN001, ANN202 - update.step_groups' signature
        if not seen:
            seen.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                         for g in groups for p in g.params])
        return step_groups(groups, dist)

    monkeypatch.setattr(update, "step_groups", recording)
    trainer.model.train()
    metrics = trainer.step(1)
    return seen[0], metrics


@pytest.mark.parametrize("case", CASES)
def test_micro_batch_1_equals_one_micro_batch(world, tmp_path, case, monkeypatch):
    # the smallest micro-batch each config allows: 1 row, or 2 sequences (a DPO / Bradley-Terry
    # pair; the RM and PRM configs count sequences too)
    smallest = 2 if command_of(case) in ("dpo", "kto", "online_dpo", "rm", "prm") else 1
    one = _first_step(world, tmp_path, case, smallest, monkeypatch)
    whole = _first_step(world, tmp_path, case, 64, monkeypatch)
    (g1, m1), (g2, m2) = one, whole
    assert len(g1) == len(g2) and sum(float(g.abs().sum()) for g in g2) > 0
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for k in m2:
        if k.startswith("loss/"):
            assert m1[k] == pytest.approx(m2[k], abs=1e-5), k


def _same_update(one: tuple[list, dict], other: tuple[list, dict]) -> None:
    (g1, m1), (g2, m2) = one, other
    assert len(g1) == len(g2) and sum(float(g.abs().sum()) for g in g2) > 0
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert any(k.startswith("loss/") for k in m2)
    for k in m2:
        if k.startswith("loss/"):
            assert m1[k] == pytest.approx(m2[k], abs=1e-5), k


@pytest.mark.parametrize("loss_agg", AGGS)
@pytest.mark.parametrize("case", BUDGETED)
def test_token_budget_equals_one_row_per_micro_batch(world, tmp_path, case, loss_agg,
                                                     monkeypatch):
    """`micro_batch_tokens`: rows grouped by width under a 24-token budget (2-4 of this
    world's 5-11-token rows a micro-batch; 300 for the tool episodes, of up to ~130 tokens)
    give the update of one row a micro-batch, for each loss aggregation."""
    calls: list[int] = []
    grouped = update.token_budget_micro_batches

    def counting(items, widths, budget):  # noqa: ANN001, ANN202 - the engine's signature
        out = grouped(items, widths, budget)
        calls.extend(len(m) for m in out)
        return out

    monkeypatch.setattr(update, "token_budget_micro_batches", counting)
    tokens = 300 if "tools" in case else 24
    budget = _first_step(world, tmp_path, case, 64, monkeypatch, micro_batch_tokens=tokens,
                         loss_agg=loss_agg)
    assert calls and max(calls) > 1, calls  # some micro-batches hold several rows
    _same_update(_first_step(world, tmp_path, case, 1, monkeypatch, loss_agg=loss_agg), budget)


@pytest.mark.parametrize("case", CASES)
def test_packing_gives_the_padded_first_update(world, tmp_path, case, monkeypatch):
    """`packing: true`: the first update (every gradient, every loss) equals the padded one,
    with one micro-batch of several rows (so rows really share the packed sequence); a trainer
    that cannot pack yet refuses the key in one line before any model loads."""
    if not getattr(trainer_class(command_of(case)), "supports_packing", False):
        with pytest.raises(ConfigError, match="config key 'packing': `posttrain .*` does not "
                                              "support it yet") as err:
            build(case, case_keys(world, case, tmp_path, packing=True))
        assert "\n" not in str(err.value)
        return
    PAD_COUNT.take()
    packed = _first_step(world, tmp_path, case, 64, monkeypatch, packing=True)
    padded, total = PAD_COUNT.take()
    assert padded == 0 < total, (padded, total)  # the learner computed no padding
    _same_update(_first_step(world, tmp_path, case, 64, monkeypatch), packed)
