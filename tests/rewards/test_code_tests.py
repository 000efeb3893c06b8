"""Test formats and the type-strict comparison outside the sandbox (posttrain.sandbox.tests),
their validation at data load, and honest scores for value and stdin/stdout tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.data.loading import DataError, load_rows
from posttrain.rewards import code_reward, code_reward_detailed, split_tests
from posttrain.sandbox.io import ProtocolError
from posttrain.sandbox.tests import (
    CodeTest,
    CompareOptions,
    decode_value,
    is_plain,
    parse_test,
    stdout_equal,
    values_equal,
)
from posttrain.sandbox.wire import wire_encode
from posttrain.tasks.functions import code_rows
from tests.sandbox.test_adversarial_programs import mode

__all__ = ["mode"]  # the fixture: bwrap and limits mode


@pytest.mark.parametrize(("snippet", "name", "expected", "prelude"), [
    ("assert f(1) == 5", "f", 5, ""),
    ("assert f(1) == -5.5, 'message'", "f", -5.5, ""),
    ("assert 5 == f(1)", "f", 5, ""),  # the literal may be on the left
    ("assert f([1, 2]) == [2, 1]", "f", [2, 1], ""),
    ("assert f() == {'a': (1, None), 2: True}", "f", {"a": (1, None), 2: True}, ""),
    ("import math\nassert f(x=2) == 'ab'", "f", "ab", "import math"),  # imports only
])
def test_value_shape_is_recognised(snippet: str, name: str, expected: object,
                                   prelude: str) -> None:
    test = parse_test(snippet)
    assert (test.kind, test.expr, test.expected, test.source) == ("value", name, expected,
                                                                  prelude)
    message = json.dumps(test.sandbox_message(0))
    assert "expected" not in message and repr(expected) not in message


@pytest.mark.parametrize("snippet", [
    "assert f(1) != 5", "assert f(1) == g(1)", "assert f(1)", "assert f(1) == 5 == g(1)",
    "assert f(1) == {1, 2}",  # a set is not plain data of the value path
    "assert f(1) == 5\nassert f(2) == 7",  # two checks in one test
    "if True:\n    assert f(0) == 1\nassert f(1) == 5",  # an assert in the prelude
    "def check(candidate):\n    assert candidate(1) == 5\ncheck(f)",
    # issue 23: an expression that holds the comparison, a helper, a prelude that is not an
    # import, a name the prelude binds, a non-finite literal: all go to the judge
    "assert (f(1) == 5) == True", "assert f(1) - 5 == 0", "assert bool(f(1) == 5) == True",
    "assert str(f(1) == 5) == 'True'", "x = f(1)\nassert x == 5",
    "from math import isclose\nassert isclose(f(1), 5) == True",
    "import operator\nassert operator.eq(f(1), 5) == True",
    "assert f(1) == 1e309", "assert f(g(1)) == 5", "assert f(*[1]) == 5",
])
def test_other_snippets_go_to_the_judge(snippet: str) -> None:
    test = parse_test(snippet)
    assert test == CodeTest("assert", snippet)
    assert test.sandbox_message(3) == {"kind": "assert", "index": 3}  # the source never


def test_the_function_task_is_all_value_tests() -> None:
    for row in code_rows(50, seed=3):
        assert {parse_test(t).kind for t in row["tests"]} == {"value"}


@pytest.mark.parametrize(("got", "expected", "options", "equal"), [
    (5, 5, {}, True),
    (5.0, 5, {}, False),  # 5.0 is not 5 ...
    (5.0, 5, {"int_float": True}, True),  # ... unless int_float
    (True, 1, {}, False),  # True is not 1 ...
    (True, 1, {"bool_int": True}, True),  # ... unless bool_int
    (True, 1.0, {"bool_int": True, "int_float": True}, False),  # no bool/float bridge
    (0.1 + 0.2, 0.3, {}, False),  # exact by default, like the assert
    (0.1 + 0.2, 0.3, {"float_abs_tol": 1e-9}, True),
    (100.0001, 100.0, {"float_rel_tol": 1e-5}, True),
    ([1, 2], (1, 2), {}, False),
    ([1, [2, "a"]], [1, [2, "a"]], {}, True),
    ([1, 2], [1, 2, 3], {}, False),
    ({"a": 1, 2: [None]}, {2: [None], "a": 1}, {}, True),
    ({1: "x"}, {True: "x"}, {}, False),  # key types are strict too
    ({"a": 1.0}, {"a": 1}, {"int_float": True}, True),
    ({"a": 1}, {"a": 1, "b": 2}, {}, False),
    (None, 0, {}, False),
    ("5", 5, {}, False),
])
def test_values_equal(got: object, expected: object, options: dict, equal: bool) -> None:
    assert values_equal(got, expected, CompareOptions(**options)) is equal


def test_plain_data_and_decoding() -> None:
    class Int(int):
        pass

    assert is_plain([1, (2.0, "s"), {"k": None, (1, 2): True}])
    assert not is_plain(Int(5)) and not is_plain([Int(5)]) and not is_plain({1, 2})
    assert not is_plain(b"x") and not is_plain(object())
    deep: list = []
    for _ in range(150):
        deep = [deep]
    assert not is_plain(deep)  # refused beyond 100 levels
    assert decode_value('["l", 1, ["t", 2, "a"]]') == (True, [1, (2, "a")])
    big = 10**400 + 1  # huge ints travel exactly (hex), no digit limit
    assert decode_value(json.dumps(wire_encode(big))) == (True, big)
    # valid wire values that are not plain data of the value path, or not finite: they fail
    for text in ('["s", 1, 2]', '["b", "78"]', '["c", "0x0p+0", "0x1p+0"]', '["f", "inf"]',
                 '["l", ["f", "nan"]]', '["h", 3]'):
        assert decode_value(text) == (False, None), text
    # not the wire form at all: a protocol error (the whole run is a sandbox_error)
    for text in ("{1, 2}", "b'x'", "__import__('os')", "f(1)", "inf", "1" * 5000, "[" * 500,
                 "1j", "", "5.0", "NaN", "5#1", '["f"]', '["d", 1]', '["s", 1, 1]',
                 '["d", 1, 2, true, 3]', str(2**60)):
        with pytest.raises(ProtocolError):
            decode_value(text)


@pytest.mark.parametrize(("got", "expected", "mode", "equal"), [
    ("6\n", "6", "rstrip", True),
    ("1 2  \n3\n\n\n", "1 2\n3", "rstrip", True),
    ("1 2\r\n3\r\n", "1 2\n3\n", "rstrip", True),
    ("1  2\n3", "1 2\n3", "rstrip", False),
    ("1  2\n3", "1 2 3", "tokens", True),
    ("6\n", "6", "exact", False),
    ("", "6", "tokens", False),
])
def test_stdout_equal(got: str, expected: str, mode: str, equal: bool) -> None:
    assert stdout_equal(got, expected, mode) is equal


def test_bad_compare_options() -> None:
    with pytest.raises(ValueError, match=r"unknown compare option\(s\) \['tol'\]"):
        CompareOptions.from_any({"tol": 1e-6})
    with pytest.raises(ValueError, match="float_abs_tol must be a number >= 0"):
        CompareOptions(float_abs_tol=-1)
    with pytest.raises(ValueError, match="stdout must be one of"):
        CompareOptions(stdout="fuzzy")


@pytest.mark.parametrize(("tests", "message"), [
    ([{"input": "1", "output": "2", "x": 1}], "exactly the keys"),
    ([{"inputs": ["1"], "outputs": ["2"]}], "exactly the keys"),
    ([{"input": "1", "output": 2}], "'output' must be a string"),
    ([{}], "exactly the keys"),
    ([3], "expected a string"),
    ("assert (", "do not compile"),
    (3, "must be a string or a list"),
])
def test_unknown_shapes_are_errors_never_passes(tests: object, message: str) -> None:
    """Dict tests used to become no-op expressions that any program passed."""
    with pytest.raises(ValueError, match=message):
        split_tests(tests)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        code_reward("x = 1", tests)  # type: ignore[arg-type]


def test_both_formats_are_validated_at_load(tmp_path: Path) -> None:
    good = [{"prompt": "p", "tests": ["assert f(1) == 5", {"input": "1\n", "output": "2"}]},
            {"prompt": "p", "tests": "assert f(1) == 5\nassert f(2) == 7"}]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good))
    assert load_rows(path, "code") == good
    assert load_rows(path, "prompts") == good  # RL prompts of a code task: checked as well
    bad = good + [{"prompt": "p", "tests": ["assert f(1) == 5", {"in": "1", "out": "2"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    for kind in ("code", "prompts"):
        with pytest.raises(DataError, match=r"code.jsonl:3: field 'tests': test 1: a dict test "
                                            r"must have exactly the keys \['input', 'output'\]"):
            load_rows(path, kind)


def test_honest_value_tests_of_every_plain_type(mode: str) -> None:
    program = ("def f(x):\n    return {'n': None, 'b': x > 0, 'i': x, 'f': x / 2, 's': str(x),"
               " 'l': [x], 't': (x, x)}\n")
    expected = "{'n': None, 'b': True, 'i': 3, 'f': 1.5, 's': '3', 'l': [3], 't': (3, 3)}"
    assert code_reward(program, [f"assert f(3) == {expected}"], mode=mode) == 1.0
    # a tuple is not a list
    assert code_reward(program, ["assert f(3)['t'] == [3, 3]"], mode=mode) == 0.0
    assert code_reward("def f():\n    return 5.0", ["assert f() == 5"], mode=mode) == 0.0
    assert code_reward("def f():\n    return 5.0", ["assert f() == 5"],
                       compare={"int_float": True}, mode=mode) == 1.0
    assert code_reward("def f():\n    return 0.1 + 0.2", ["assert f() == 0.3"],
                       compare={"float_abs_tol": 1e-9}, mode=mode) == 1.0


def test_honest_stdio_tests(mode: str) -> None:
    program = "a, b = map(int, input().split())\nprint(a + b)\n"
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"},
             {"input": "2 2", "output": "5"}, {"input": "x", "output": "x"}]
    score, result = code_reward_detailed(program, tests, partial=True, mode=mode)
    assert score == 0.5  # wrong answer and a crash (ValueError) fail; the rest pass
    assert result.test_status == ["passed", "passed", "failed", "failed"]
    assert result.test_kinds == ["stdio"] * 4 and result.in_process_verdicts == 0
    # a crash on one input does not skip the other stdin/stdout tests
    assert code_reward(program, tests[3:] + tests[:1], partial=True, mode=mode) == 0.5
    assert code_reward("import sys\nprint(sys.stdin.read()[::-1], end='')\nraise SystemExit(0)",
                       [{"input": "abc", "output": "cba"}], mode=mode) == 1.0
    assert code_reward("print(3)\nraise SystemExit(1)", [{"input": "", "output": "3"}],
                       mode=mode) == 0.0
    assert code_reward("print(3, end='  \\n\\n')", [{"input": "", "output": "3"}],
                       compare={"stdout": "exact"}, mode=mode) == 0.0


def test_stdout_over_the_cap_fails() -> None:
    from posttrain.rewards import SandboxLimits

    limits = SandboxLimits(max_output_bytes=100)
    program = "print('7')\nprint(' ' * 1000)"  # right answer, then more than the cap
    assert code_reward(program, [{"input": "", "output": "7"}], limits=limits) == 0.0
    assert code_reward("print('7')", [{"input": "", "output": "7"}], limits=limits) == 1.0


def test_in_process_verdicts_are_counted() -> None:
    program = "def f(x):\n    return 2 * x + 3\ndef apply(g, x):\n    return g(x)\n"
    tests = ["assert f(1) == 5", "assert f(2) > 6", "assert f(3) != 0", "assert f(4) == 11",
             "assert apply(lambda x: x + 1, 1) == 2"]  # a callback: the judge cannot carry it
    score, result = code_reward_detailed(program, tests)
    assert score == 1.0
    assert result.test_kinds == ["value", "assert", "assert", "value", "assert"]
    assert result.in_process_verdicts == 1  # the judge decided the other two asserts
