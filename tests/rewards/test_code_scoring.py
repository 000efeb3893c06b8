"""Honest programs scored right (issue 23): code extraction, string tests in order, huge ints,
ASCII-only token matching, a batch that survives any one input."""

from __future__ import annotations

import logging

import pytest

from posttrain.rewards import code_reward, code_reward_detailed, code_rewards_batch
from posttrain.rewards.code import extract_program, split_tests
from posttrain.sandbox.tests import stdout_equal
from tests.sandbox.test_adversarial_programs import mode

__all__ = ["mode"]

F = "def f(x):\n    return 2 * x + 3\n"
TESTS = ["assert f(1) == 5", "assert f(2) == 7"]


@pytest.mark.parametrize(("completion", "program"), [
    (f"~~~python\n{F}~~~\n", F),  # tilde fences
    (f"~~~~\n{F}~~~~\n", F),
    ("```python\ns = '```'\ndef f(x):\n    return 2 * x + 3\n```\n",  # backticks in a string
     "s = '```'\ndef f(x):\n    return 2 * x + 3\n"),
    (f"```python\n{F}```\nUsage:\n```python\nprint(f(3))\n```\n", F),  # a usage example
    (f"```python\nimport math\n```\n```python\n{F}```\n```python\nf(1)\n```",
     "import math\n" + F),  # imports + solution, not the example
    (f"```python\n{F}```\n```bash\npython main.py\n```\n", F),  # other languages ignored
    (f"Here:\n```python\n{F}", F),  # an unclosed last block runs to the end
    (f"```python\ndef f(x):\n    return 0\n```\nFixed:\n```python\n{F}```",
     "def f(x):\n    return 0\n" + F),  # both solutions, the later definition wins
    ("```python\nprint(1)\n```\n```python\nprint(2)\n```", "print(2)\n"),  # scripts: last
    ("``` python\nX = 1\n```", "X = 1\n"),
])
def test_extraction_rule(completion: str, program: str) -> None:
    assert extract_program(completion) == program


@pytest.mark.parametrize("completion", [
    f"~~~python\n{F}~~~\n",
    "```python\ns = '```'\ndef f(x):\n    return 2 * x + 3\n```\n",
    f"```python\n{F}```\nUsage:\n```python\nprint(f(3))\nassert f(3) == 0\n```\n",
    f"Here:\n```python\n{F}",
    f"```python\ndef f(x):\n    return 0\n```\nFixed:\n```python\n{F}```",
])
def test_honest_completions_score_full(completion: str) -> None:
    assert code_reward(completion, TESTS, timeout_s=2.0) == 1.0


def test_string_tests_run_in_order(mode: str) -> None:
    tests = "x = f(1)\nassert x == 5\nx = f(2)\nassert x == 7\n"
    assert split_tests(tests) == ["x = f(1)\nassert x == 5", tests]  # prefixes, then all
    assert code_reward(F, tests, 2.0, partial=True, mode=mode) == 1.0
    wrong = "def f(x):\n    return 5\n"  # right for f(1) only
    assert code_reward(wrong, tests, 2.0, partial=True, mode=mode) == 0.5


def test_string_tests_keep_decorators_and_class_bodies(mode: str) -> None:
    tests = ("from dataclasses import dataclass\n"
             "@dataclass\nclass Case:\n    x: int\n    y: int\n"
             "    def ok(self):\n        return f(self.x) == self.y\n"
             "assert Case(1, 5).ok()\n"
             "assert Case(2, 7) == Case(2, 7) and Case(2, 7).ok()\n")
    score, result = code_reward_detailed(F, tests, 2.0, True, mode=mode)
    assert score == 1.0 and result.in_process_verdicts == 0, result.test_status


def test_huge_ints_compare_exactly(mode: str) -> None:
    big = 10**400 + 7
    program = f"def f(x):\n    return {big} if x else {big - 1}\n"
    for compare in ({}, {"int_float": True}, {"int_float": True, "float_abs_tol": 1e-6}):
        assert code_reward(program, [f"assert f(1) == {big}"], compare=compare,
                           mode=mode) == 1.0
        assert code_reward(program, [f"assert f(0) == {big}"], compare=compare,
                           mode=mode) == 0.0
    as_float = "def f(x):\n    return 1e300\n"
    assert code_reward(as_float, [f"assert f(1) == {big}"], compare={"int_float": True},
                       mode=mode) == 0.0


def test_tokens_split_on_ascii_whitespace_only() -> None:
    assert stdout_equal("1 2\t3\n", "1\n2 3", "tokens")
    for separator in ("\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\u2028", "\u3000"):
        assert not stdout_equal(f"1{separator}2", "1 2", "tokens"), repr(separator)
    assert code_reward("print('1\\x1f2')", [{"input": "", "output": "1 2"}],
                       compare={"stdout": "tokens"}) == 0.0


def test_no_input_sinks_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    big = 10**400
    completions = [F, F, F, "def f(x):\n    return 1e308\n", F]
    tests = [TESTS, "assert (", [{"inputs": ["1"]}], [f"assert f(1) == {big}"], TESTS]
    with caplog.at_level(logging.ERROR, logger="posttrain.rewards.code"):
        scores = code_rewards_batch(completions, tests, timeout_s=2.0, max_workers=2,
                                    compare={"int_float": True, "float_rel_tol": 1e-9})
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert sum("scored 0.0" in r.getMessage() for r in caplog.records) == 2  # the bad rows


@pytest.mark.parametrize("where", ["block", "bare"])
def test_text_too_deep_to_parse_scores_zero(mode: str, where: str) -> None:
    """A 60,000-term sum makes `ast.parse` (the solution check) and `compile` (the sandbox)
    raise RecursionError; model text is data: the reward is 0, never an error (issue 56)."""
    body = "def f():\n    return " + "+".join(["1"] * 60_000) + "\n"
    completion = f"```python\n{body}```\n" if where == "block" else body
    assert extract_program(completion).startswith("def f():")
    score, result = code_reward_detailed(completion, ["assert f() == 60000"], mode=mode)
    assert score == 0.0 and result.status == "failed"
