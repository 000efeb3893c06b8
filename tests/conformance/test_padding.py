"""Every registered trainer logs `perf/pad_fraction` every step: padded / all positions of
its learner's forward passes (the conformance world's rows have uneven lengths: 0 < it < 1)."""

from __future__ import annotations

import pytest

from tests.conformance.conftest import CASES, build, case_keys, metric_rows


@pytest.mark.parametrize("case", CASES)
def test_every_trainer_logs_its_pad_fraction(world, tmp_path, case):
    keys = case_keys(world, case, tmp_path, max_steps=2, save_every=0, eval_size=2)
    build(case, keys).train()
    steps = [r for r in metric_rows(tmp_path) if "perf/step_seconds" in r]
    assert [r["step"] for r in steps] == [1, 2], steps
    for r in steps:
        assert 0.0 < r["perf/pad_fraction"] < 1.0, (r["step"], r["perf/pad_fraction"])
