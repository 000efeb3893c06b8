"""Model text never stops a run (issue 56): a program's failure is the python tool's answer, a
closed episode never beats a finished one, and the async sampler runs the python tool in the
run's sandbox mode."""

from __future__ import annotations

import queue
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from posttrain.rewards.registry import Rewards, RewardSpec, environment_reward
from posttrain.rollout import tools
from posttrain.rollout.episodes import AgentSampler, check_failing_tools
from posttrain.rollout.hf import SamplingParams
from posttrain.rollout.tools import AgentSpec, ToolCall, call_tools
from posttrain.sandbox import SandboxResult, SandboxUnavailableError, run_sandboxed
from posttrain.sandbox.jail import script_answer
from tests.rollout.script_lm import ScriptedHF, ScriptLM, ids
from tests.rollout.test_tools import TOK, Slow, call


@pytest.fixture(scope="module")
def bwrap() -> None:
    try:
        run_sandboxed("", mode="strict")
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")


@pytest.mark.parametrize(("code", "says"), [
    ("print('half')\nraise ValueError('boom')", "half\nerror: the program raised"),
    ("raise SystemExit(3)", "error: the program raised an exception or exited with a non-zero"),
    ("x = [0] * 10**10", "error: the program ran out of memory"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "error: the program was killed"),
])
def test_a_programs_failure_is_the_python_tools_answer(bwrap, code: str, says: str) -> None:
    out = tools.python(code)
    assert out.startswith(says), out


def test_a_program_that_runs_too_long_answers_before_the_call_times_out(bwrap) -> None:
    """The sandbox's limit ends before the call's, so the answer is the program's timeout,
    never a timed-out call (which the failing-tools rule counts)."""
    jobs = [({"python": tools.python}, [ToolCall("python", {"code": "while True: pass"})])]
    t0 = time.monotonic()
    got = call_tools(jobs, 3.0)[0][0]
    assert time.monotonic() - t0 < 3.5
    assert got.error is None and "error: the program ran past its time limit" in got.content


def test_failing_programs_never_trip_the_failing_tools_rule(bwrap) -> None:
    jobs = [({"python": tools.python}, [ToolCall("python", {"code": f"raise KeyError({i})"})])
            for i in range(3)]
    results = [r for episode in call_tools(jobs, 10.0) for r in episode]
    assert [r.error for r in results] == [None] * 3
    check_failing_tools([[{"python": [3, sum(r.error is not None for r in results), ""]}]])


def test_only_a_sandbox_that_did_not_run_is_the_tools_failure() -> None:
    for detail in ("sandbox did not start: no bwrap", "bad report: junk",
                   "cannot start the sandbox: OSError()"):
        with pytest.raises(RuntimeError, match="the sandbox did not run"):
            script_answer(SandboxResult("sandbox_error", 0, 1, detail=detail), 5.0)
    broke = SandboxResult("sandbox_error", 0, 1, detail="stopped after test 0: sandbox_error")
    assert script_answer(broke, 5.0) == "error: the program broke the sandbox's protocol"
    assert script_answer(SandboxResult("passed", 1, 1, stdout="7\n"), 5.0) == "7\n"


class Scored:
    def __init__(self, score: float | None) -> None:
        self.score = score

    def get_reward(self) -> float | None:
        return self.score


def test_a_closed_episode_scores_the_lowest_finished_score() -> None:
    envs = [Scored(-1.0), Scored(1.0), None, Scored(0.5)]
    closed = [False, False, True, False]
    assert environment_reward(["a"] * 4, envs, closed) == [-1.0, 1.0, -1.0, 0.5]
    assert environment_reward(["a"] * 2, [None, None], [True, True]) == [None, None]
    assert environment_reward(["a"], [Scored(0.0)]) == [0.0]  # no field: nothing closed
    # through the scorer: the closed episode (wrong and timed out on purpose) never beats the
    # finished wrong one
    rows = [{"environments": e, "environment_closed": c} for e, c in zip(envs, closed, strict=True)]
    scores = Rewards([RewardSpec("environment")]).score(["a"] * 4, rows).scores
    assert scores[2] <= min(scores[i] for i in (0, 1, 3))


def test_a_timed_out_environment_call_marks_the_episode_closed() -> None:
    t1 = call("wait", s=0.8) + "</s>"
    inner = ScriptedHF(TOK)
    inner.script_model = ScriptLM(ids(TOK, "<s>Q\n" + t1 + "x" * 400), len(TOK))
    inner.update_weights(inner.script_model, 0)
    r = AgentSampler(inner, AgentSpec({}, Slow, 1, 0.2)).generate(
        [], rows=[{"prompt": "Q"}], group_size=1,
        params=SamplingParams(len(ids(TOK, t1)) + 150, greedy=True))
    assert r.rows[0]["environments"] is None and r.rows[0]["environment_closed"] is True
    time.sleep(1.0)


def test_the_sampler_process_takes_the_runs_sandbox_mode(monkeypatch) -> None:
    """`sampler_main` (the spawned process's entry) sets the python tool's mode its setup
    gives before it builds anything; the learner's setup carries its own (`python_mode()`)."""
    import os

    from posttrain.engine import async_rollout, sampler_loop, sampler_start

    monkeypatch.setattr(tools, "_SANDBOX_MODE", {"mode": "strict"})
    before = signal.getsignal(signal.SIGINT)
    results: queue.Queue = queue.Queue()
    try:
        setup: queue.Queue = queue.Queue()  # config, agent, rewards, threads, mode, tokenizer,
        setup.put((None, None, None, torch.get_num_threads(), "limits",  # policy, probe
                   None, torch.nn.Linear(1, 1), ""))
        sampler_loop.sampler_main(os.getppid(), setup, queue.Queue(), results, None, None,
                                  None)
    finally:
        signal.signal(signal.SIGINT, before)
    assert tools.python_mode() == "limits"
    assert results.get_nowait()  # it failed later (no config), and said so to the learner

    class Jobs(queue.Queue):
        def cancel_join_thread(self) -> None:
            pass

    proc = type("P", (), {"is_alive": lambda self: False})()
    parts = sampler_start.SamplerParts(proc, Jobs(), Jobs(), Jobs(), None, None, None)
    monkeypatch.setattr(async_rollout, "start_sampler", lambda: parts)
    cfg = SimpleNamespace(out_dir=".")  # where the sampler's traceback would go
    async_rollout.SamplerProcess(cfg, None, None, 1).attach(None, torch.nn.Linear(1, 1))
    assert parts.setup.get_nowait()[4] == "limits"
    with pytest.raises(ValueError, match="expected strict or limits"):
        tools.python_mode("bwrap")
