"""A TRL user's agent script (issue 48): what the command line says when a run stops because a
user's function failed (item 12), and `benchmarks/claims.py --table` before any job (item 9)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain.cli as cli
from posttrain.core.errors import UserFunctionError
from posttrain.rewards.errors import RewardFunctionError

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["grpo", "model=m", "train_data=d.jsonl", "report_to=[]"]


def _tool_failure_error() -> type[Exception]:
    """ToolFailureError wherever it lives (posttrain/rollout/ or the prompt-RL trainer)."""
    for module in ("posttrain.rollout.tools", "posttrain.rollout.episodes", "posttrain.rollout",
                   "posttrain.trainers.prompt_rl"):
        found = getattr(importlib.import_module(module), "ToolFailureError", None)
        if found is not None:
            return found
    raise AssertionError("ToolFailureError not found")


def _stopped_by(error: Exception, monkeypatch, capsys) -> tuple[int, list[str]]:
    def fail(command, cfg):
        raise error

    monkeypatch.setattr(cli, "train", fail)
    code = cli.main(ARGS)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_reward_and_a_tool_failure_stop_with_one_line(monkeypatch, capsys):
    class ToolBroke(UserFunctionError):
        kind = "tool"

    reward = RewardFunctionError("r", 3, ValueError("no"), "text")
    for error, start in ((reward, "posttrain grpo: reward error: reward function 'r' failed"),
                         (ToolBroke("tool 'calc' failed on 3 of its 4 calls"),
                          "posttrain grpo: tool error: tool 'calc' failed on 3 of its 4")):
        code, lines = _stopped_by(error, monkeypatch, capsys)
        assert code == 1 and len(lines) == 1 and lines[0].startswith(start)


def test_the_real_tool_failure_stops_with_one_line(monkeypatch, capsys):
    error = _tool_failure_error()("tool 'calc' failed on 3 of its 4 calls this step")
    code, lines = _stopped_by(error, monkeypatch, capsys)
    assert code == 1 and len(lines) == 1 and "tool 'calc' failed on 3 of its 4" in lines[0]


@pytest.mark.parametrize("script, needle", [
    ("claims.py", "no finished jobs"),
    ("async_grpo.py", "not finished"),  # issue 57 item 7
])
def test_a_benchmark_table_before_any_run_is_one_line(tmp_path, script, needle):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--table",
                          "--out", str(tmp_path / "none")], capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""}, cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "--table" in lines[0]


def test_a_dead_sampler_process_stops_with_one_line(monkeypatch, capsys):
    """Issue 57: SamplerDied (async_rollouts) ends in one CLI line, never a traceback."""
    from posttrain.engine.async_rollout import SamplerDied

    died = SamplerDied("the sampler process exited (code -9) without a result; docs/async.md")
    code, lines = _stopped_by(died, monkeypatch, capsys)
    assert code == 1 and lines == ["posttrain grpo: sampler error: the sampler process exited "
                                   "(code -9) without a result; docs/async.md"]


def test_a_sampler_error_message_prints_no_traceback(tmp_path, capsys):
    """A reward's failure raised in the sampler is raised as it is (the CLI's one line); any
    other error becomes SamplerDied with its last line, the traceback written to a file."""
    import pickle
    import queue

    import pytest

    from posttrain.engine.async_rollout import SamplerDied, SamplerProcess

    sampler = SamplerProcess.__new__(SamplerProcess)
    sampler.out_dir, sampler.results = str(tmp_path), queue.Queue()
    sampler.ready, sampler.sent = {}, set()
    reward = RewardFunctionError("r", 3, ValueError("no"), "text")
    other = RuntimeError("boom")
    for err, kind in ((reward, RewardFunctionError), (other, SamplerDied)):
        sampler.results.put(pickle.dumps(("error", (err, "Traceback ...\nRuntimeError: boom\n"))))
        with pytest.raises(kind) as raised:
            sampler._receive(0.1)
        assert capsys.readouterr().err == ""  # nothing printed before the one line
    message = str(raised.value)
    assert "RuntimeError: boom" in message and "sampler_traceback.txt" in message
    assert "Traceback" in (tmp_path / "sampler_traceback.txt").read_text()


def test_vllm_benchmark_without_vllm_is_one_line_at_once(tmp_path):
    """Issue 57: `benchmarks/vllm_vs_hf.py` checks vLLM before building the world and SFT."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the benchmark would run, not refuse")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_vs_hf.py"), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}, cwd=tmp_path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs vLLM: pip install" in lines[0]
    assert not (tmp_path / "o").exists()  # nothing built
