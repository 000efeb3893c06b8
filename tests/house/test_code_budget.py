"""The code budget (scripts/code_budget.py): every family within its code lines, prose between
10% and 36% of its lines; a family pushed over fails."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("code_budget", ROOT / "scripts" / "code_budget.py")
budget = importlib.util.module_from_spec(spec)
sys.modules["code_budget"] = budget  # dataclasses look their module up
spec.loader.exec_module(budget)


def test_the_library_is_within_its_budget() -> None:
    assert budget.problems(budget.count(ROOT)) == []
    assert budget.long_docstrings(ROOT) == []


def test_a_long_module_docstring_is_named(tmp_path: Path) -> None:
    (tmp_path / "posttrain" / "ops").mkdir(parents=True)
    (tmp_path / "posttrain" / "ops" / "x.py").write_text('"""' + "a\n" * 16 + '"""\nx = 1\n')
    (tmp_path / "posttrain" / "tasks").mkdir()  # the demo world: not library code
    (tmp_path / "posttrain" / "tasks" / "y.py").write_text('"""' + "a\n" * 30 + '"""\n')
    assert budget.long_docstrings(tmp_path) == [
        "posttrain/ops/x.py: a module docstring of 17 lines (at most 15)"]


def test_code_docstrings_and_comments_are_told_apart() -> None:
    source = ('"""Module doc\n\nover lines."""\n\nimport os  # a comment\n\n\n'
              'def f(x: int) -> int:\n    """Doc."""\n    # only a comment\n'
              '    y = """a string\nthat is code"""\n    return x\n')
    n = budget.count_source(source)
    # 13 lines; code: import, def, y = (2 lines), return = 5; doc: 3 + 1; comment: line 10
    assert (n.total, n.code, n.doc, n.comment) == (13, 5, 4, 1)


def test_a_family_pushed_over_its_budget_fails(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "posttrain", tmp_path / "posttrain")
    counts = budget.count(tmp_path)
    room = budget.BUDGETS["rollout"] - counts["rollout"].code
    filler = '"""Padding."""\n' + "".join(f"x{i} = {i}\n" for i in range(room + 1))
    (tmp_path / "posttrain" / "rollout" / "padding.py").write_text(filler)
    found = budget.problems(budget.count(tmp_path))
    assert any(p.startswith("rollout: ") and "over its budget" in p for p in found), found
    assert budget.problems(budget.count(tmp_path), {**budget.BUDGETS, "rollout": 10**6}) == []


def test_prose_outside_its_range_fails() -> None:
    counts = {"ops": budget.Lines(total=100, code=90, doc=5, comment=0)}
    assert budget.problems(counts, {"ops": 1000}, 10**6) == [
        "ops: docstrings + comments are 5% of its lines, outside 10%-36%"]
    counts["ops"] = budget.Lines(total=100, code=50, doc=40, comment=0)
    assert "40%" in budget.problems(counts, {"ops": 1000}, 10**6)[0]
