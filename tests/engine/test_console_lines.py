"""A line of key metrics per logged step when stderr is not a terminal (issue 24, item 8)."""

from __future__ import annotations

import io

import pytest

from posttrain.engine.tracking import MetricsLogger, console_line
from posttrain.trainers.grpo import GRPOTrainer


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_console_line_format():
    line = console_line(5, {"reward/mean": 0.5, "loss/policy": 0.012345, "perf/step_seconds":
                            1.25, "other": 3.0, "kl/mean": float("nan")}, 100, "run")
    assert line == "[run] step 5/100 loss/policy=0.01235 reward/mean=0.5 perf/step_seconds=1.25"


def test_the_async_step_line_shows_staleness_and_queue_depth():
    """Issue 57: without a terminal an async run's line shows what its progress bar does."""
    line = console_line(3, {"reward/mean": 0.5, "async/staleness_mean": 1.0,
                            "async/queue_groups": 8.0, "async/learner_wait_s": 0.1}, 10)
    assert line == "step 3/10 reward/mean=0.5 async/staleness_mean=1 async/queue_groups=8"


@pytest.mark.parametrize(("tty", "progress", "printed"), [
    (False, True, True), (True, True, False), (False, False, False)])
def test_lines_only_without_a_terminal(tmp_path, monkeypatch, tty, progress, printed):
    stream = _Stream(tty)
    monkeypatch.setattr("sys.stderr", stream)
    logger = MetricsLogger(tmp_path, [], "run", {"progress": progress, "max_steps": 3})
    logger.log(1, {"reward/mean": 0.25})
    logger.close()
    assert (stream.getvalue() == "[run] step 1/3 reward/mean=0.25\n") is printed
    assert stream.getvalue() == "" or printed


def test_python_api_prints_every_log_every_steps(toy_world, tmp_path, capsys):
    GRPOTrainer(model=toy_world["model"], train_data=toy_world["data"], out_dir=str(tmp_path),
                rewards=["tests.trainers.toy_rewards:sevens"], group_size=2,
                prompts_per_step=2, max_new_tokens=4, max_steps=4, log_every=2, threads=1,
                report_to=[], progress=True).train()
    lines = [x for x in capsys.readouterr().err.splitlines() if " step " in x]
    assert [x.split(" ")[2] for x in lines] == ["2/4", "4/4"]
    assert all("reward/mean=" in x and "perf/step_seconds=" in x for x in lines)
