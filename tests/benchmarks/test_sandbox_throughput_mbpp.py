"""benchmarks/sandbox_throughput.py --mbpp: rows of MBPP's shape (made up here, no MBPP data)
become a reference and two wrong programs each, plain Python tells a broken reference apart,
and the report counts what the judge gives."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ROWS = [
    {"task_id": 1, "code": "def twice(x):\r\n    return 2 * x", "test_setup_code": "",
     "test_list": ["assert twice(2) == 4", "assert twice(0) == 0"], "challenge_test_list": []},
    {"task_id": 2, "code": "class Box:\r\n    def __init__(self, v):\r\n        self.v = v\r\n"
                           "def unbox(b):\r\n    return b.v",
     "test_setup_code": "b = Box(3)", "test_list": ["assert unbox(b) == 3"],
     "challenge_test_list": []},
    {"task_id": 3, "code": "def wrong(x):\r\n    return x", "test_setup_code": "",
     "test_list": ["assert wrong(1) == 2"], "challenge_test_list": []},
]


def _bench():
    spec = importlib.util.spec_from_file_location("sandbox_throughput",
                                                  ROOT / "benchmarks" / "sandbox_throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sandbox_throughput", module)
    spec.loader.exec_module(module)
    return module


def test_tests_programs_and_entry_points() -> None:
    bench = _bench()
    assert bench.mbpp_tests(ROWS[1]) == ["b = Box(3)\nassert unbox(b) == 3"]
    assert [bench.entry_point(row) for row in ROWS] == ["twice", "unbox", "wrong"]
    cases = bench.mbpp_programs(ROWS)
    assert [(task, kind) for task, kind, _, _ in cases[:3]] == [
        (1, "reference"), (1, "other"), (1, "none")]
    assert cases[1][2].endswith("twice = unbox\n")  # the next row's solution, renamed


def test_plain_python_tells_right_from_wrong() -> None:
    bench = _bench()
    verdicts = [bench.plain_python(program, tests, 10.0)
                for _, _, program, tests in bench.mbpp_programs(ROWS)]
    # row 3's reference is wrong in plain Python too; its renamed neighbour (row 1's `twice`)
    # happens to pass it, as a wrong program can; every other wrong program fails
    assert verdicts == [True, False, False, True, False, False, False, True, False]


def test_report_counts_the_judges_verdicts(tmp_path, capsys) -> None:
    bench = _bench()
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    bench.mbpp_report(str(path), "auto", 10.0)
    out = capsys.readouterr().out
    assert "references: 2 of 3 score 1.0 (plain Python passes 2)" in out
    assert "task 3: failed (value test; plain Python fails)" in out
    assert "judge fails but plain Python passes: 0" in out
    assert "judge passes but plain Python fails: []" in out
    assert ("wrong programs: 6, score > 0: 1 (where plain Python fails: 0) "
            "[(3, 'other', True)]") in out
