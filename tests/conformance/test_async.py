"""Asynchronous rollouts (`async_rollouts`, docs/async.md): exactness and faults.

`max_staleness: 0` is the synchronous run (the same samples, metrics and weights); the sampler
process killed stops the run with its exit code; a reward raising in the sampler is reported as
in a synchronous run; Ctrl-C and a killed trainer leave no sampler process behind. Resume
after kill -9, signals, first-step ratios and no full logits run as the conformance case
`grpo_async`.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from posttrain.engine.async_rollout import Sampled, SamplerDied, fresh, needed_version
from posttrain.engine.checkpoint import list_checkpoints
from posttrain.rollout import Rollout
from tests.conformance.conftest import build, case_keys, comparable, metric_rows, weights
from tests.conformance.test_resume import run

pytestmark = pytest.mark.slow
ASYNC = {"async_rollouts": True}


def _marked() -> list[int]:
    """Pids of live processes started with this test's MARK in their environment."""
    out = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if MARK.encode() in env.read_bytes():
                out.append(int(env.parent.name))
        except OSError:
            continue
    return out


MARK = f"POSTTRAIN_ASYNC_TEST={uuid.uuid4().hex}"


def test_staleness_0_is_the_synchronous_run(world, tmp_path):
    runs = {}
    for name, extra in {"sync": {}, "async": {**ASYNC, "max_staleness": 0}}.items():
        keys = case_keys(world, "grpo", tmp_path / name, save_every=0, log_completions=16)
        build("grpo", {**keys, **extra}).train()
        runs[name] = tmp_path / name
    a, b = (comparable(metric_rows(runs[n])) for n in ("sync", "async"))
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in b] == a
    assert all(r["async/staleness_max"] == 0 for r in b if "async/staleness_max" in r)
    sampled = [(runs[n] / "completions.jsonl").read_text() for n in ("sync", "async")]
    assert sampled[0] == sampled[1] and sampled[0].count("\n") == 6 * 16
    wa, wb = weights(runs["sync"] / "final"), weights(runs["async"] / "final")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_groups_lag_by_max_staleness_and_the_correction_weighs_them(world, tmp_path):
    keys = case_keys(world, "grpo", tmp_path, save_every=0, max_staleness=2, **ASYNC)
    build("grpo", keys).train()
    rows = [r for r in metric_rows(tmp_path) if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert all(r["async/dropped_stale"] == 0 for r in rows)
    # token_truncate (rollout_is: auto): the sampler/learner gap is measured, 0 at lag 0
    assert rows[0]["rollout/logprob_abs_diff"] < 1e-5 < rows[2]["rollout/logprob_abs_diff"]


def test_the_schedule_and_the_staleness_guard():
    # 2 steps behind allowed: step 5 samples with the weights after step 2
    assert [needed_version(s, 0, 2) for s in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert needed_version(5, 4, 2) == 4  # resumed at 4: nothing older exists
    one = Rollout.from_sequences([[1]] * 4, [[2]] * 4, [[0.0]] * 4, [False] * 4,
                                 group_size=2, pad_token_id=0)
    items = [Sampled(3, v, one, None) for v in (0, 1, 2)]  # type: ignore[arg-type]
    kept, dropped = fresh(items, 3, 2)  # version 0 is 3 behind: its 2 groups dropped
    assert [s.version for s in kept] == [1, 2] and dropped == 2


def test_a_killed_sampler_stops_the_run_in_seconds(world, tmp_path):
    trainer = build("grpo", case_keys(world, "grpo", tmp_path, **ASYNC))
    trainer.model.train()
    trainer.step(1)
    os.kill(trainer.rollouts_async.proc.proc.pid, signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(SamplerDied, match="exited \\(code -9\\)"):
        trainer.step(2)
        trainer.step(3)
    assert time.time() - t0 < 10
    trainer.close_sampler()


@pytest.mark.parametrize("on_error", ["raise", "auto"])
def test_a_reward_raising_in_the_sampler_is_reported_as_in_a_synchronous_run(
        world, tmp_path, on_error, capfd):
    reward = [{"name": "tests.trainers.toy_rewards:crash_on_a", "weight": 1.0}]
    seen = {}
    for name, extra in {"sync": {}, "async": {**ASYNC, "max_staleness": 0}}.items():
        keys = case_keys(world, "grpo", tmp_path / name, rewards=reward, save_every=0,
                         reward_on_error=on_error, max_steps=2, **extra)
        if on_error == "raise":
            with pytest.raises(Exception) as err:
                build("grpo", keys).train()
            seen[name] = (type(err.value), str(err.value))
        else:
            build("grpo", keys).train()
            rows = comparable(metric_rows(tmp_path / name))
            seen[name] = [{k: v for k, v in r.items() if k.startswith("reward/")}
                          for r in rows]
            assert any(r.get("reward/errors/tests.trainers.toy_rewards.crash_on_a", 0) > 0
                       for r in rows)
    assert seen["sync"] == seen["async"]
    if on_error == "raise":
        assert "crashed on purpose" in seen["async"][1]


def test_ctrl_c_keeps_the_checkpoint_and_leaves_no_sampler(world, tmp_path, monkeypatch):
    monkeypatch.setenv(*MARK.split("="))
    out = tmp_path / "run"
    proc = run("grpo", case_keys(world, "grpo", out, max_steps=4, save_every=0, **ASYNC),
               "--signal", "step", "INT")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(out)] == [2] and not (out / "final").exists()
    assert _marked() == []


def test_a_killed_trainer_leaves_no_sampler(world, tmp_path, monkeypatch):
    monkeypatch.setenv(*MARK.split("="))
    proc = run("grpo", case_keys(world, "grpo", tmp_path, **ASYNC), "--kill-step", "3")
    assert proc.returncode == -signal.SIGKILL
    deadline = time.time() + 5
    while _marked() and time.time() < deadline:
        time.sleep(0.2)
    assert _marked() == []


def test_tool_episodes_run_in_the_sampler_as_in_the_learner(world, tmp_path):
    """Multi-turn episodes (the `grpo_tools` case) at max_staleness 0: the same episodes and
    updates; the sampler/learner gap `rollout/*` (tool episodes always recompute pi_old) is
    rounding in both (~4e-7), not bit-equal across processes."""
    runs = {}
    for name, extra in {"sync": {}, "async": {**ASYNC, "max_staleness": 0}}.items():
        keys = case_keys(world, "grpo_tools", tmp_path / name, save_every=0, max_steps=3,
                         log_completions=16, **extra)
        build("grpo_tools", keys).train()
        runs[name] = [{k: v for k, v in r.items() if not k.startswith("async/")}
                      for r in comparable(metric_rows(tmp_path / name))]
    assert (tmp_path / "sync" / "completions.jsonl").read_text() == (
        tmp_path / "async" / "completions.jsonl").read_text()
    assert any(r.get("agent/tool_calls", 0) > 0 for r in runs["async"])
    for a, b in zip(runs["sync"], runs["async"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert (a[k] == pytest.approx(b[k], abs=1e-6) if k.startswith("rollout/")
                    else a[k] == b[k]), k


def test_what_cannot_go_to_the_sampler_process_is_refused_before_the_model_loads(world,
                                                                                  tmp_path):
    from posttrain.config import ConfigError
    from posttrain.trainers.grpo import GRPOTrainer

    keys = case_keys(world, "grpo", tmp_path, **ASYNC)
    keys.pop("rewards")
    with pytest.raises(ConfigError, match="'async_rollouts'.*pickling"):
        GRPOTrainer(rewards=[lambda completion: 1.0], **keys)
