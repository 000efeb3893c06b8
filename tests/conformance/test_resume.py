"""`kill -9` in the middle of a step, then `resume_from: latest`, equals an uninterrupted run.

For every registered trainer (and PPO's LoRA critic): `save_every: 1`, a cosine schedule with
warm-up, an epoch boundary after the crash (18 prompts / pairs / step rows at 4 a step: the
order is reshuffled in step 5; 17 SFT rows: the epoch ends in step 5). Every logged metric
except `perf/*` and times, and every final weight, must be EQUAL: the same deterministic
CPU kernels on one thread see the same weights, optimizer moments, schedules, data order,
generators and trainer state, so any difference is state that was not saved or restored.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from posttrain.engine.checkpoint import list_checkpoints
from tests.conformance.conftest import (
    CASES,
    ROOT,
    build,
    case_keys,
    command_of,
    comparable,
    metric_rows,
    weights,
)

pytestmark = pytest.mark.slow


def run(command: str, keys: dict, *flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tests.conformance.runner", command, json.dumps(keys), *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("case", CASES)
def test_kill_9_mid_step_then_resume_equals_uninterrupted(world, tmp_path, case):
    full = tmp_path / "full"
    build(case, case_keys(world, case, full)).train()
    keys = case_keys(world, case, tmp_path / "crashed")
    proc = run(command_of(case), keys, "--kill-step", "4")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    crashed = tmp_path / "crashed"
    assert [s for s, _ in list_checkpoints(crashed)] == [2, 3]  # keep_checkpoints: 2
    resumed = build(case, {**keys, "resume_from": "latest"})
    assert resumed.start_step == 3
    resumed.train()
    a, b = metric_rows(full), metric_rows(crashed)
    assert [r["step"] for r in b] == [r["step"] for r in a]
    assert comparable(b) == comparable(a)
    wa, wb = weights(full / "final"), weights(crashed / "final")
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    if command_of(case) == "ppo":  # the critic (saved at the end) resumed too
        ca, cb = weights(full / "critic"), weights(crashed / "critic")
        ca.update(weights(full / "critic" / "adapters" / "critic")
                  if (full / "critic" / "adapters").is_dir() else {})
        cb.update(weights(crashed / "critic" / "adapters" / "critic")
                  if (crashed / "critic" / "adapters").is_dir() else {})
        assert ca.keys() == cb.keys() and ca
        for k in ca:
            assert torch.equal(ca[k], cb[k]), k
    summary = json.loads((crashed / "summary.json").read_text())
    assert [h["step"] for h in summary["history"]] == list(range(1, 7))
