"""The code budget (scripts/code_budget.py): every family within its count plus its stated
allowance, every file within its code-line cap, prose between 10% and 36% of its lines; a family
or a file pushed over fails; `PEERS` rows are a peer's file at a named version, counted by the
same counter; docs/architecture.md's tables are the script's."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("code_budget", ROOT / "scripts" / "code_budget.py")
budget = importlib.util.module_from_spec(spec)
sys.modules["code_budget"] = budget  # dataclasses look their module up
spec.loader.exec_module(budget)


def test_the_library_is_within_its_budget() -> None:
    assert budget.problems(budget.count(ROOT)) == []
    assert budget.long_docstrings(ROOT) == []
    assert budget.over_cap(budget.file_sizes(ROOT)) == []


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
    assert budget.main([str(tmp_path)]) == 1  # the command fails too
    (tmp_path / "posttrain" / "rollout" / "padding.py").unlink()
    assert budget.main([str(tmp_path)]) == 0


def test_a_budget_is_the_count_and_a_stated_modest_allowance() -> None:
    for fam, (code, room, why) in budget.FAMILIES.items():
        assert budget.BUDGETS[fam] == code + room, fam
        assert 0 < room <= max(10, 0.05 * code) and len(why) > 10, (fam, room, why)
    code, room, _ = budget.LIBRARY_AT
    assert budget.LIBRARY == code + room
    assert room < sum(r for _, r, _ in budget.FAMILIES.values())


def test_a_file_is_capped_by_its_code_lines(tmp_path: Path, capsys) -> None:
    for folder, n in (("ops", 251), ("trainers", 300), ("engine", 600)):
        (tmp_path / "posttrain" / folder).mkdir(parents=True)
        body = '"""Doc."""\n' + "# a comment\n" * 300 + "".join(f"x{i} = {i}\n" for i in range(n))
        (tmp_path / "posttrain" / folder / "x.py").write_text(body)
    sizes = budget.file_sizes(tmp_path)
    # 552-901 physical lines each: only the ops file is over, by its code lines
    assert budget.over_cap(sizes) == ["posttrain/ops/x.py: 251 code lines, over its cap of 250"]
    assert budget.near_cap(sizes) == ["posttrain/engine/x.py: 600 of 600 code lines (100%)",
                                      "posttrain/trainers/x.py: 300 of 400 code lines (75%)"]
    assert budget.main([str(tmp_path)]) == 1
    said = capsys.readouterr()
    assert "code_budget: posttrain/ops/x.py: 251 code lines, over its cap of 250" in said.err
    assert "near its cap: posttrain/trainers/x.py: 300 of 400" in said.out


def test_a_peer_file_is_counted_like_ours(tmp_path: Path) -> None:
    source = ('"""Module."""\nimport os  # one\n\n\nclass A:\n    """Doc."""\n\n'
              '    @staticmethod\n    def f(x):\n        # a comment\n        def inner():\n'
              '            return x\n        return inner\n\n    def g(self):\n'
              '        self.a = self.args.a\n        self.b = 2\n\n\ndef h():\n    pass\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(source)
    (tmp_path / "pkg" / "n.py").write_text("y = 1\n")
    path = tmp_path / "pkg" / "m.py"
    # code: import, class, decorator, def f, def inner, return x, return inner, def g, 2 self.,
    # def h, pass
    assert budget.count_path(path) == 12 == budget.count_source(source).code
    assert budget.count_path(path, ("A.f",)) == 5  # the decorator counts with its function
    assert budget.count_path(path, ("A.f.inner", "h")) == 4
    assert budget.count_path(path, ("A",), r"self\.\w+ = self\.args\.") == 1
    assert budget.count_path(tmp_path / "pkg") == 13
    assert budget.main(["--count", str(path), "A.g"]) == 0
    with pytest.raises(SystemExit, match="no function or class 'A.nope'"):
        budget.count_path(path, ("A.nope",))


def test_every_peer_row_is_a_file_at_a_version_with_its_code_lines() -> None:
    for feature, (peers, ours) in budget.PEERS.items():
        assert ours > 0, feature
        if isinstance(peers, str):  # no peer: the row says why
            assert peers.startswith("no peer"), feature
            continue
        for p in peers:
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", p.repo), (feature, p)
            assert re.fullmatch(r"v\d+(\.\d+)+|[0-9a-f]{40}", p.version), (feature, p)
            assert p.code > 0 and not p.path.startswith("/"), (feature, p)


def test_the_docs_tables_are_the_scripts() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert budget.budget_table() in text, "run `python scripts/code_budget.py --table`"
    assert budget.peers_table() in text, "run `python scripts/code_budget.py --peers`"


def test_prose_outside_its_range_fails() -> None:
    counts = {"ops": budget.Lines(total=100, code=90, doc=5, comment=0)}
    assert budget.problems(counts, {"ops": 1000}, 10**6) == [
        "ops: docstrings + comments are 5% of its lines, outside 10%-36%"]
    counts["ops"] = budget.Lines(total=100, code=50, doc=40, comment=0)
    assert "40%" in budget.problems(counts, {"ops": 1000}, 10**6)[0]
