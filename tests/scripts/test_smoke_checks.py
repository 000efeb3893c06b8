"""scripts/smoke_checks.py (the checks of scripts/gpu_smoke.sh) on hand-written metrics.jsonl
files, and (slow) a small subset of the smoke script end to end on the CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("smoke_checks", ROOT / "scripts" / "smoke_checks.py")
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)


def _rows(*steps: dict) -> list[dict]:
    """An eval row, then one training row per dict (step numbers from 1)."""
    return [{"step": 0, "eval/accuracy": 0.0},
            *({"step": i + 1, **s} for i, s in enumerate(steps))]


def test_metrics_jsonl_is_read_with_nan(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss/total": NaN}\n\n{"step": 2, "loss/total": 0.5}\n')
    rows = sc.read_metrics(path)
    assert len(rows) == 2 and rows[1]["loss/total"] == 0.5
    with pytest.raises(sc.CheckFailed, match="missing"):
        sc.read_metrics(tmp_path / "nope.jsonl")


def test_finite_losses():
    ok = _rows({"loss/policy": 0.1, "train/grad_norm": 2.0,
                "critic/explained_variance": float("nan")})
    assert "1 steps, losses finite" in sc.check_finite_losses(ok)  # non-loss NaN is allowed
    for bad in ({"loss/policy": float("nan")}, {"loss/value": float("inf")},
                {"loss/policy": 0.1, "critic/grad_norm": float("nan")}):
        with pytest.raises(sc.CheckFailed, match="non-finite"):
            sc.check_finite_losses(_rows({"loss/x": 0.0}, bad))
    with pytest.raises(sc.CheckFailed, match="no training step"):
        sc.check_finite_losses([{"step": 0, "eval/accuracy": 1.0}])


def test_every_push_must_be_verified():
    assert "gap max 0.003 over 2 steps" in sc.check_push_gaps(_rows(
        {"loss/x": 0.1, "rollout/push_check_gap": 0.002},
        {"loss/x": 0.1, "rollout/push_check_gap": 0.003}))
    with pytest.raises(sc.CheckFailed, match=r"missing at steps \[1, 2\]"):
        sc.check_push_gaps(_rows({"loss/x": 0.1, "rollout/push_check_gap": 0.002},
                                 {"loss/x": 0.0}))


def test_first_step_kl_reads_the_first_training_step_only():
    assert "< 0.0001" in sc.check_first_step_kl(
        _rows({"loss/kl": 0.0, "kl/token_mean": 5e-5}, {"loss/kl": 1.0, "kl/token_mean": 3.0}))
    with pytest.raises(sc.CheckFailed, match="is not < 0.0001"):
        sc.check_first_step_kl(_rows({"loss/kl": 0.0, "kl/token_mean": 2e-4}))
    with pytest.raises(sc.CheckFailed, match="is not < 0.0001"):  # PPO logs two KL keys
        sc.check_first_step_kl(_rows({"loss/v": 0.0, "kl/token_mean": 0.0, "kl/mean": -0.01}))
    with pytest.raises(sc.CheckFailed, match="logs none of"):
        sc.check_first_step_kl(_rows({"loss/policy": 0.0}))


def test_gap_required_or_noted():
    gap = {"rollout/logprob_abs_diff": 0.01, "rollout/k3": 1e-4}
    rows = _rows({"loss/p": 0.0, **gap}, {"loss/p": 0.0, **gap, "rollout/k3": 3e-4})
    text = sc.check_gap(rows, required=True)
    assert "rollout/k3 first 0.0001 max 0.0003" in text
    partial = _rows({"loss/p": 0.0, **gap}, {"loss/p": 0.0})
    with pytest.raises(sc.CheckFailed, match="not logged at every step"):
        sc.check_gap(partial, required=True)
    assert "SKIP" in sc.check_gap(partial, required=False)
    with pytest.raises(sc.CheckFailed, match="not finite"):
        sc.check_gap(_rows({"loss/p": 0.0, **gap, "rollout/k3": float("nan")}), required=True)


def test_gap_bound_and_engine_log(tmp_path):
    """The vLLM parts: the gap is bounded and not exactly 0; the run printed the engine line."""
    rows = _rows({"loss/p": 0.0, "rollout/logprob_abs_diff": 0.01},
                 {"loss/p": 0.0, "rollout/logprob_abs_diff": 0.03})
    assert "mean |logp diff| 0.02 < 0.05" in sc.check_gap_bound(rows, 0.05)
    with pytest.raises(sc.CheckFailed, match=">= 0.01"):
        sc.check_gap_bound(rows, 0.01)
    with pytest.raises(sc.CheckFailed, match="did not come from a separate engine"):
        sc.check_gap_bound(_rows({"loss/p": 0.0, "rollout/logprob_abs_diff": 0.0}), 0.05)
    with pytest.raises(sc.CheckFailed, match="never printed 'Initializing a V1 LLM engine'"):
        sc.run_checked(tmp_path, [sys.executable, "-c", "print('hf sampler')"], kl=False,
                       gap=False, metrics=False, reload=False,
                       log_has="Initializing a V1 LLM engine")


def test_library_logs_scans_the_source(tmp_path):
    (tmp_path / "m.py").write_text('metrics["rollout/k3"] = k3\n')
    assert sc.library_logs("rollout/k3", tmp_path)
    assert not sc.library_logs("rollout/logprob_abs_diff", tmp_path)


def test_text_chars():
    assert (sc.text_chars(""), sc.text_chars("abcd"), sc.text_chars("x" * 40)) == (0.0, 0.25, 1.0)


def test_reload_of_a_tiny_qwen2(tmp_path):
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.tiny import build_tiny_qwen2
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_qwen2(tok, hidden_size=16, num_layers=1, num_heads=2,
                                     num_kv_heads=1, intermediate_size=32), tok, tmp_path / "m")
    assert "reloads as Qwen2ForCausalLM" in sc.check_reload(tmp_path / "m", vocab_size=151936)
    with pytest.raises(sc.CheckFailed, match="vocab_size 151936 != 104"):
        sc.check_reload(tmp_path / "m", vocab_size=104)
    with pytest.raises(sc.CheckFailed, match="no config.json"):
        sc.check_reload(tmp_path / "absent")


@pytest.mark.slow
def test_gpu_smoke_script_runs_a_subset_on_cpu(tmp_path):
    """`DEVICE=cpu ONLY=grpo bash scripts/gpu_smoke.sh`: the world, one checked GRPO run."""
    env = {**os.environ, "DEVICE": "cpu", "ONLY": "grpo", "PYTHON": sys.executable,
           "WORK": str(tmp_path / "work"), "KEEP": "1"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("PASS")] == ["device", "world", "grpo"]
    assert not [ln for ln in lines if ln.startswith("FAIL")]
    assert any("first-step KL" in ln for ln in lines) and "gpu_smoke: PASS" in lines[-1]
    rows = sc.train_rows(sc.read_metrics(tmp_path / "work" / "grpo" / "metrics.jsonl"))
    assert len(rows) == 2 and any(r["train/grad_norm"] > 0 for r in rows)  # the reward varies
