"""Every Python block of README.md and docs/*.md (issue 48, item 10): docs drift fails here.

A block fenced ```python runs, in a fresh temporary working directory (what it writes stays
there); ```python sketch marks a fragment that is not meant to run (it uses names it does not
define, or data and models it does not build): it must parse and its import lines run, so a
moved name still fails. ```python slow runs only in the slow suite. Any other word after
`python` is an error here, so a misspelt marker does not silently skip a block.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(python[^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
MARKERS = {"sketch", "slow"}


def _blocks() -> list:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            words = match.group(1).split()[1:]
            where = f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}"
            marks = [pytest.mark.slow] if "slow" in words else []
            out.append(pytest.param(where, words, match.group(2), id=where, marks=marks))
    return out


BLOCKS = _blocks()


def test_the_docs_have_python_blocks_to_check():
    assert len(BLOCKS) >= 8 and any(not p.values[1] for p in BLOCKS)  # some run, not only sketches


@pytest.mark.parametrize(("where", "words", "code"), BLOCKS)
def test_docs_python_block(where, words, code, tmp_path, monkeypatch):
    assert set(words) <= MARKERS, f"{where}: unknown fence marker(s) {set(words) - MARKERS}"
    tree = ast.parse(code, where)  # every block is valid Python
    if "sketch" in words:  # not meant to run: its imports still must
        tree = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
                          type_ignores=[])
    monkeypatch.chdir(tmp_path)
    exec(compile(tree, where, "exec"), {"__name__": "__docs__"})  # noqa: S102 - our own docs
