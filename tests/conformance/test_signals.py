"""SIGTERM / SIGINT in any phase stops a run cleanly and resumably, for every trainer.

The signal arrives during the first evaluation, a step, a checkpoint write or the final
evaluation. That phase finishes; the process exits 0 with a checkpoint of the last finished
step and `summary.json` naming `stopped_at_step`, and without `final/`; `resume_from: latest`
then completes the run (its final weights and summary written).
"""

from __future__ import annotations

import json

import pytest

from posttrain.engine.checkpoint import list_checkpoints
from tests.conformance.conftest import CASES, build, case_keys, command_of
from tests.conformance.test_resume import run

pytestmark = pytest.mark.slow
# phase -> (signal, the step the run stops at with max_steps 3)
PHASES = {"eval_before": ("TERM", 0), "step": ("INT", 2), "checkpoint": ("TERM", 1),
          "eval_after": ("INT", 3)}


@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize("case", CASES)
def test_a_signal_in_any_phase_stops_cleanly_and_resumes(world, tmp_path, case, phase):
    sig, stops_at = PHASES[phase]
    out = tmp_path / "run"
    keys = case_keys(world, case, out, max_steps=3, save_every=0 if phase != "checkpoint" else 1)
    proc = run(command_of(case), keys, "--signal", phase, sig)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_at_step"] == stops_at
    assert stops_at in [s for s, _ in list_checkpoints(out)]
    assert not (out / "final").exists()
    resumed = build(case, {**keys, "resume_from": "latest"})
    assert resumed.start_step == stops_at
    resumed.train()
    done = json.loads((out / "summary.json").read_text())
    assert "stopped_at_step" not in done and done["steps"] == 3
    assert [h["step"] for h in done["history"]] == [1, 2, 3]
    assert (out / "final").is_dir()
