"""A set reaches the other process in its iteration order and is rebuilt to iterate the same,
or the test fails (issue 56: MBPP task 341 passed here and failed in plain Python, its set
argument rebuilt in another order). Both sandbox modes (the `mode` fixture)."""

from __future__ import annotations

import ast
import random

import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from posttrain.sandbox.program import _fill
from posttrain.sandbox.tests import _literal
from posttrain.sandbox.wire import SET_ORDER, WireError, same_order_set, wire_decode, wire_encode
from tests.sandbox.test_adversarial_programs import mode

__all__ = ["mode"]

DISPLAY = "{12, 13, 14, 15, 16}"
PYTHON = list(eval(DISPLAY))  # plain Python's order of that display: 16 first (its layout)
SORTED = sorted(PYTHON)


def _score(program: str, tests: str, mode: str) -> float:
    return code_reward_detailed(program, tests, 3.0, partial=True, mode=mode,
                                limits=SandboxLimits(timeout_s=3.0))[0]


def test_the_display_is_not_iterated_in_sorted_order() -> None:
    """The cases below need a display whose order differs from adding its items one by one."""
    assert PYTHON != SORTED and list(ast.literal_eval(DISPLAY)) == SORTED


@pytest.mark.parametrize("where", ["value", "judge"])
def test_a_set_argument_iterates_as_in_plain_python(mode: str, where: str) -> None:
    """`value`: MBPP's assert shape, the arguments sent by the parent; `judge`: the set made
    by the test's code in the judge process and shared with the program."""
    program = "def set_to_tuple(s):\n    return tuple(s)\n"
    call = f"set_to_tuple({DISPLAY})" if where == "value" else "set_to_tuple(S)"
    prelude = "" if where == "value" else f"S = {DISPLAY}\n"
    wrong = f"{prelude}assert {call} == {tuple(SORTED)}\n"  # plain Python: fails
    honest = f"{prelude}assert {call} == {tuple(PYTHON)}\n"
    assert _score(program, wrong, mode) == 0.0
    assert _score(program, honest, mode) == 1.0


def test_a_set_the_program_makes_iterates_in_the_judge_as_in_plain_python(mode: str) -> None:
    program = f"def make():\n    return {DISPLAY}\n"
    assert _score(program, f"assert list(make()) == {SORTED}\n", mode) == 0.0
    assert _score(program, f"assert list(make()) == {PYTHON}\n", mode) == 1.0


def test_a_program_set_the_judge_cannot_rebuild_in_order_fails_the_test(mode: str) -> None:
    """{3, 11} iterates 11 first (3 took its home slot, 11 probed on to slot 0); filled in
    that order 11 takes the home slot, so no fill gives plain Python's order: the test fails
    whichever order it expects (an honest loss; never a pass Python would not give)."""
    python = list({3, 11})
    assert python == [11, 3]
    program = "def make():\n    return {3, 11}\n"
    for expected in (python, python[::-1]):
        assert _score(program, f"assert list(make()) == {expected}\n", mode) == 0.0
    assert _score(program, "assert len(make()) == 2\n", mode) == 0.0  # it fails whole


def test_a_parent_literal_is_the_compiled_display() -> None:
    ok, value = _literal(ast.parse(f"[{DISPLAY}, 1]", mode="eval").body)
    assert ok and list(value[0]) == PYTHON


def _sets(seed: int, count: int) -> list[set]:
    """Sets of several histories: displays, set(list), comprehensions, adds and discards."""
    rnd = random.Random(seed)

    def item() -> object:
        return rnd.choice([rnd.randint(-100, 100), rnd.randint(0, 10**6), rnd.random(),
                           (rnd.randint(0, 5), rnd.randint(-3, 64)), "ab"[rnd.randint(0, 1)]])
    made = []
    for _ in range(count):
        items = [item() for _ in range(rnd.randint(1, 40))]
        kind = rnd.choice(["display", "set", "comprehension"])
        s = (eval("{" + ", ".join(map(repr, items)) + "}") if kind == "display" else
             set(items) if kind == "set" else {x for x in items})
        for x in items[: rnd.randint(0, 3)]:
            s.discard(x)
        made.append(s)
    return made


def test_a_rebuilt_set_iterates_as_sent_or_is_refused() -> None:
    """Property: on the program's side, decoding (`same_order_set`) and filling a shared set
    (`_fill`) never give another order than the sender's: the same order, or
    WireError(SET_ORDER) (the test fails). A display of a run of ints rebuilds."""
    rebuilt = refused = 0
    for sent in _sets(0, 2000):
        order = list(sent)
        for how in ("decode", "fill"):
            try:
                got = wire_decode(wire_encode(sent)) if how == "decode" else \
                    _filled(set(range(50)), sent)
            except WireError as err:
                assert err.args == (SET_ORDER,)
                refused += 1
                continue
            assert [(type(x), x) for x in got] == [(type(x), x) for x in order]
            rebuilt += 1
    assert rebuilt and refused  # both happen on these histories
    sent = {3, 11}  # the judge's side takes the nearest set, never refuses
    assert wire_decode(wire_encode(sent), in_order=False) == sent
    kept: set = set()
    _fill(kept, sent, in_order=False)
    assert kept == sent
    for n in range(1, 60):  # a run of ints in any order: no two share a slot
        small = eval("{" + ", ".join(str(n + (7 * i) % n) for i in range(n)) + "}")
        assert list(same_order_set(list(small))) == list(small)


def _filled(obj: set, new: set) -> set:
    _fill(obj, new)
    return obj
