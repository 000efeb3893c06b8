"""2 gloo ranks under torchrun equal 1 process, for every registered trainer.

Data parallel for every trainer, FSDP2 for those that support it (the others must refuse
`fsdp: true` before any model loads). The world has uneven completion lengths (the model's
EOS logit depends strongly on the context), `share_prompt_prefix` on (the default: data
parallel shares prompts, FSDP2 runs the plain forward; the 1-process reference does the
same), and an uneven last SFT batch (one row: one rank has none in that step). Losses within
1e-5; grad norms within 5e-5 relative (each rank's micro-batches hold other rows, so the
shared-prompt forward pads and sums in another order: 2.2e-5 seen for GRPO; a missing or
doubled gradient sum is a factor of ~2); final weights within 1e-3 of how far training moved
them (Adam divides by each element's running RMS, so an element whose gradient is ~0 up to
summation order moves by up to lr either way; a missing or doubled gradient sum moves every
tensor by a share of its whole update).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import ConfigError
from posttrain.trainers import trainer_class
from tests.conformance.conftest import (
    CASES,
    ROOT,
    VARIANTS,
    build,
    case_keys,
    command_of,
    metric_rows,
    spread_problem,
    weights,
)

pytestmark = pytest.mark.slow
# time and memory are measured per process, not computed from the data: not compared. A clip
# fraction counts tokens past a threshold: one whose value sits within float error of it can
# flip with the summation order (1 of ~250 tokens seen), so those compare within 0.02.
PER_RUN = ("perf/", "gpu/", "async/")
ONE_PROCESS = [c for c in CASES if VARIANTS.get(c, ("", {}))[1].get("async_rollouts")]
"""Cases torchrun refuses (the sampler process serves one learner process: docs/async.md)."""
MODES = [(c, "dp") for c in CASES if c not in ONE_PROCESS] + [
    (c, "fsdp") for c in CASES if trainer_class(command_of(c)).supports_fsdp
    and "lora_r" not in VARIANTS.get(c, ("", {}))[1]
    and "tools" not in VARIANTS.get(c, ("", {}))[1]  # FSDP2 + tools: refused
    and c not in ONE_PROCESS] + [
    # packing (docs/performance.md): each rank packs its own rows; the policy, reference and
    # old log-prob forwards (grpo), the critic's (ppo) and a pair trainer's (dpo); FSDP2 too
    (c, "dp-packed") for c in ("grpo", "ppo", "dpo")] + [
    (c, "fsdp-packed") for c in ("grpo", "sft") if trainer_class(command_of(c)).supports_fsdp]


def torchrun(command: str, keys: dict) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=2", "-m", "posttrain", command] + [
        f"{k}={json.dumps(v)}" for k, v in keys.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


def _close_weights(one: Path, two: Path, start: Path) -> None:
    wa, wb, w0 = weights(one), weights(two), weights(start)
    assert wa.keys() == wb.keys() and wa
    moved = sum(float((wa[k] - w0[k]).square().sum()) for k in wa if k in w0) ** 0.5
    assert moved > 0
    for k in wa:
        diff = float((wb[k] - wa[k]).norm())
        ref = float((wa[k] - w0[k]).norm()) if k in w0 else float(wa[k].norm())
        assert diff <= 1e-3 * ref + 1e-6, (k, diff, ref)


@pytest.mark.parametrize("case,mode", MODES, ids=[f"{c}-{m}" for c, m in MODES])
def test_two_ranks_equal_one_process(world, tmp_path, case, mode):
    extra = {"max_steps": 5, "save_every": 0}
    if mode.startswith("fsdp"):
        extra.update({"fsdp": True, "share_prompt_prefix": False})
    if mode.endswith("packed"):
        extra["packing"] = True
    one = case_keys(world, case, tmp_path / "one", **extra)
    build(case, one).train()
    torchrun(command_of(case), {**one, "out_dir": str(tmp_path / "two")})
    a, b = metric_rows(tmp_path / "one"), metric_rows(tmp_path / "two")
    a, b = [r for r in a if "train/grad_norm" in r], [r for r in b if "train/grad_norm" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 6))
    # the first update needs a real gradient (reward spread in every group): the world checks
    # it where it builds each model (`spread_problem`)
    assert spread_problem(a) is None, a[0]
    others = []  # every other logged number: the global one (counts summed over ranks, means
    # weighted, extremes MAX/MIN), summation order aside; all mismatches reported at once
    for ra, rb in zip(a, b, strict=True):
        assert set(ra) == set(rb)
        # each rank trains on its own half of the step's rows, not a replica of all of them
        assert rb["perf/rank_items"] == pytest.approx(ra["perf/rank_items"] / 2), ra["step"]
        for k in ra:
            if k.startswith("loss/"):
                assert rb[k] == pytest.approx(ra[k], abs=1e-5), (ra["step"], k)
            elif k.endswith("grad_norm"):
                assert rb[k] == pytest.approx(ra[k], rel=5e-5, abs=1e-7), (ra["step"], k)
            elif (not k.startswith(PER_RUN) and isinstance(ra[k], float | int)
                  and rb[k] != pytest.approx(ra[k], rel=1e-4, nan_ok=True,
                                             abs=0.02 if k.endswith("clipfrac") else 1e-5)):
                others.append((ra["step"], k, ra[k], rb[k]))
    assert not others, others
    if "response/length_mean" in a[0]:  # uneven completion lengths in the world
        assert any(r["response/length_mean"] < one["max_new_tokens"] for r in a)
    _close_weights(tmp_path / "one" / "final", tmp_path / "two" / "final",
                   Path(world["model"]))


@pytest.mark.parametrize("case", [c for c in CASES
                                  if not trainer_class(command_of(c)).supports_fsdp])
def test_fsdp_is_refused_where_unsupported(world, tmp_path, case):
    with pytest.raises(ConfigError, match="fsdp"):
        build(case, case_keys(world, case, tmp_path, fsdp=True))


@pytest.mark.parametrize("case", ONE_PROCESS)
def test_torchrun_is_refused_where_one_process_is_implemented(world, tmp_path, case):
    keys = case_keys(world, case, tmp_path / "two", max_steps=1)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=2", "-m", "posttrain", command_of(case)] + [
        f"{k}={json.dumps(v)}" for k, v in keys.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "config key 'async_rollouts'" in proc.stderr and "torchrun" in proc.stderr
    assert not (tmp_path / "two" / "metrics.jsonl").exists()
