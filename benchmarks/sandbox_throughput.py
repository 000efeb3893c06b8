"""Sandbox throughput: programs/s for simple passing and failing programs, serial vs the pool.

    python benchmarks/sandbox_throughput.py [--n 64] [--repeats 3] [--mode auto|bwrap|limits]

Each program defines ``f`` and is checked by three assert tests (half the programs pass, half
fail their first test). Prints the median over ``--repeats`` of programs per second for one
worker and for the bounded pool (default: one worker per core).
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

from posttrain.rewards import code_rewards_batch  # noqa: E402

PASSING = "def f(x):\n    return 2 * x + 3\n"
FAILING = "def f(x):\n    return 2 * x\n"
TESTS = ["assert f(1) == 5", "assert f(2) == 7", "assert f(3) == 9"]


def measure(n: int, workers: int, mode: str, repeats: int) -> tuple[float, list[float]]:
    """Median programs/s over ``repeats`` batches of ``n`` programs; also the last scores."""
    completions = [PASSING if i % 2 == 0 else FAILING for i in range(n)]
    rates, scores = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        scores = code_rewards_batch(completions, [TESTS] * n, timeout_s=5.0, mode=mode,
                                    max_workers=workers)
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates), scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="programs per batch")
    parser.add_argument("--repeats", type=int, default=3, help="batches; the median is shown")
    parser.add_argument("--mode", default="auto", help="sandbox mode: auto|bwrap|limits")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="pool size (default: cores)")
    args = parser.parse_args()
    code_rewards_batch([PASSING], [TESTS], mode=args.mode)  # warm-up: probes, interpreter cache
    print(f"{args.n} programs x {len(TESTS)} tests, mode={args.mode}, "
          f"median of {args.repeats}")
    for label, workers in (("serial", 1), (f"pool({args.workers})", args.workers)):
        rate, scores = measure(args.n, workers, args.mode, args.repeats)
        assert scores == [1.0 if i % 2 == 0 else 0.0 for i in range(args.n)], scores
        print(f"  {label:>10}: {rate:7.1f} programs/s")


if __name__ == "__main__":
    main()
