"""A run whose truncated share or KL jumps says so in one warning line while it trains
(issue 55 item 7: the tool world's collapse on an Intel CPU near step 33 went unsaid)."""

from __future__ import annotations

import pytest

from posttrain.engine.step_notes import StepNotes, blowup
from posttrain.trainers.grpo import GRPOTrainer
from tests.trainers.test_wrong_input_runs import _grpo


def _trend(key: str, values: list[float]) -> list[dict[str, float]]:
    return [{"step": i + 1, key: v} for i, v in enumerate(values)]


def test_the_tool_worlds_collapse_is_a_blowup():
    # truncated share: the 10 steps' lowest is 0.0, the last 0.54: up 0.54 >= 0.3
    rows = _trend("response/truncated_frac", [0.0, 0.02, 0.01, 0.0, 0.03] * 2 + [0.54])
    assert blowup(rows) == "response/truncated_frac 0 -> 0.54 (steps 1-11)"
    # KL: the window's median is 0.03 (sorted 0.02 0.02 0.03 0.03 0.03 0.03 0.04 0.04 0.05
    # 0.05: the 6th), 0.3 >= 5 x 0.03 and >= 0.1
    rows = _trend("kl/token_mean", [0.03, 0.04, 0.02, 0.05, 0.03] * 2 + [0.3])
    assert blowup(rows) == "kl/token_mean 0.03 -> 0.3 (steps 1-11)"


@pytest.mark.parametrize("key, values", [
    ("response/truncated_frac", [0.1] * 10 + [0.39]),  # +0.29
    ("response/truncated_frac", [0.0] * 9 + [0.6]),  # fewer steps than the window
    ("kl/token_mean", [0.01] * 10 + [0.09]),  # 9x, under the 0.1 floor
    ("kl/token_mean", [0.03, 0.04, 0.02, 0.05, 0.03] * 2 + [0.14]),  # 4.7x the median
])
def test_no_blowup_below_the_thresholds(key, values):
    assert blowup(_trend(key, values)) is None


def test_steps_without_the_metric_do_not_count():
    rows = _trend("kl/token_mean", [0.03] * 9 + [0.3])
    rows.insert(0, {"step": 0})  # a step that logged no KL (kl_coef 0)
    assert blowup(rows) is None  # 9 steps with a KL before the last: fewer than the window


def test_said_once_while_it_trains(toy_world, tmp_path, capsys, monkeypatch):
    fake = [0.0] * 10 + [0.6, 0.7]
    real = GRPOTrainer.step

    def step(self, n):  # noqa: ANN001, ANN202 - the real step, its truncated share replaced
        return {**real(self, n), "response/truncated_frac": fake[n - 1]}

    monkeypatch.setattr(GRPOTrainer, "step", step)
    _grpo(toy_world, tmp_path / "run", max_steps=12).train()
    lines = [x for x in capsys.readouterr().err.splitlines() if "blowing up" in x]
    assert lines == ["[grpo] warning (step 11): the policy is blowing up: "
                     "response/truncated_frac 0 -> 0.6 (steps 1-11); long wrong completions weigh "
                     "less per token under loss_agg seq-mean-token-mean; loss_agg: token-mean "
                     "(DAPO), a lower lr or a larger kl_coef hold it"]


def test_notes_of_other_ranks_say_nothing(capsys):
    notes = StepNotes("grpo", enabled=False)
    for i, v in enumerate([0.0] * 10 + [0.9], 1):
        notes.trend(i, {"response/truncated_frac": v})
    assert capsys.readouterr().err == ""
