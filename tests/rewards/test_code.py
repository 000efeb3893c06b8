"""Code reward: program extraction, test splitting, scoring, partial credit, batch, modes."""

from __future__ import annotations

import logging

import pytest

from posttrain.rewards import (
    RewardFunctionError,
    Rewards,
    RewardSpec,
    SandboxLimits,
    SandboxUnavailableError,
    code_reward,
    code_rewards_batch,
    extract_program,
    run_sandboxed,
    split_tests,
)
from posttrain.sandbox import jail as sandbox_module

GOOD = "def f(x):\n    return 2 * x + 3\n"
TESTS = ["assert f(1) == 5", "assert f(2) == 7", "assert f(3) == 9"]


@pytest.mark.parametrize(
    ("completion", "program"),
    [("```python\nA = 1\n```\ntext\n```python\nB = 2\n```", "B = 2\n"),  # the last block
     ("```py\nC = 3\n```", "C = 3\n"),
     ("```\nD = 4\n```", "D = 4\n"),
     ("Here:\n```Python3\nE = 5\n```", "E = 5\n"),
     ("F = 6", "F = 6")],  # no fence: the whole text
)
def test_extract_program(completion: str, program: str) -> None:
    assert extract_program(completion) == program


def test_split_tests_string() -> None:
    tests = "import math\nassert f(1) == 5\nx = f(2)\nassert x == 7\n"
    # test k is the string up to its k-th top-level assert; the last one is the whole string
    assert split_tests(tests) == ["import math\nassert f(1) == 5", tests]


def test_split_tests_without_asserts_is_one_test() -> None:
    tests = "def check(candidate):\n    assert candidate(1) == 5\ncheck(f)\n"
    assert split_tests(tests) == [tests]


@pytest.mark.parametrize("tests", [[], "assert (", ["assert f(1) == 5", "assert ("]])
def test_bad_tests_are_dataset_errors(tests: object) -> None:
    with pytest.raises(ValueError, match="no tests|not compile"):
        split_tests(tests)  # type: ignore[arg-type]


def test_all_pass_and_partial() -> None:
    assert code_reward(f"```python\n{GOOD}```", TESTS) == 1.0
    half = "def f(x):\n    return 5 if x == 1 else 7\n"  # passes tests 0 and 1 only
    assert code_reward(half, TESTS) == 0.0
    assert code_reward(half, TESTS, partial=True) == pytest.approx(2 / 3)


def test_string_tests_count_independently() -> None:
    half = "def f(x):\n    return 5 if x == 1 else 0\n"
    assert code_reward(half, "assert f(1) == 5\nassert f(2) == 7", partial=True) == 0.5


def test_each_test_gets_a_fresh_process() -> None:
    """State does not leak between tests: each test sees the program's fresh top level."""
    program = "counter = []\ndef f():\n    counter.append(1)\n    return len(counter)\n"
    assert code_reward(program, ["assert f() == 1", "assert f() == 1"]) == 1.0


def test_batch_matches_serial() -> None:
    completions = [GOOD, "def f(x):\n    return x", "while True: pass", GOOD]
    tests = [TESTS] * 4
    scores = code_rewards_batch(completions, tests, timeout_s=2.0, max_workers=2)
    assert scores == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="4 completions but 1 test lists"):
        code_rewards_batch(completions, tests[:1])


def test_output_is_capped_and_kept() -> None:
    program = "print('x' * 200000)\ndef f(x):\n    return 2 * x + 3\n"
    limits = SandboxLimits(max_output_bytes=1000)
    result = run_sandboxed(program, TESTS[:1], limits=limits)
    assert result.status == "passed"  # a big print is not a failure
    assert result.stdout == "x" * 1000


def test_program_without_tests_runs_once() -> None:
    assert run_sandboxed("x = 1").status == "passed"
    assert run_sandboxed("raise ValueError").status == "failed"


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"unknown sandbox mode 'docker'; valid modes"):
        run_sandboxed("x = 1", mode="docker")


def test_bad_limits() -> None:
    with pytest.raises(ValueError, match="SandboxLimits.nproc must be > 0"):
        SandboxLimits(nproc=0)


def test_strict_refuses_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "_BWRAP_OK", {True: "no bwrap", False: "no bwrap"})
    with pytest.raises(SandboxUnavailableError, match="'strict' needs bubblewrap: no bwrap"):
        code_reward(GOOD, TESTS, mode="strict")


def test_scorer_never_zeroes_a_refused_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "_BWRAP_OK", {True: "no bwrap", False: "no bwrap"})
    scorer = Rewards([RewardSpec("code", kwargs={"mode": "strict"})], on_error="zero")
    with pytest.raises(RewardFunctionError, match="needs bubblewrap"):
        scorer.score([GOOD], [{"tests": TESTS}])


def test_auto_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sandbox_module, "_BWRAP_OK", {True: "no bwrap", False: "no bwrap"})
    monkeypatch.setattr(sandbox_module, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="posttrain.sandbox.jail"):
        first = run_sandboxed(GOOD, TESTS, mode="auto")
        second = run_sandboxed(GOOD, TESTS, mode="auto")
    assert first.mode == second.mode == "limits"
    assert first.status == second.status == "passed"
    warnings = [r for r in caplog.records if "isolation are OFF" in r.getMessage()]
    assert len(warnings) == 1
