"""Seconds per step of two checkouts of posttrain side by side: a refactor's speed check.

    git worktree add /tmp/base <commit>
    OMP_NUM_THREADS=2 python benchmarks/compare_trees.py --a /tmp/base --b . --reps 4

Runs `benchmarks/vs_trl.py`'s work (GRPO: 8 x 8 samples of <= 32 new tokens; DPO: 8 pairs,
both on the 19M Llama by default) with each tree's own code, in its own process, interleaved
A B A B per (algorithm, setting), and prints the median s/step of each tree and the ratio
B / A with its min and max over the repetitions (> 1: B is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run(tree: Path, spec: dict) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(tree / "benchmarks" / "vs_trl.py"), "--one",
                           json.dumps(spec)], capture_output=True, text=True, cwd=tree, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {proc.stderr.strip().splitlines()[-3:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["s_per_step"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=Path, required=True)
    ap.add_argument("--b", type=Path, required=True)
    ap.add_argument("--model", default="19M")
    ap.add_argument("--settings", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--algos", nargs="+", default=["grpo", "dpo"])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", default="/tmp/vs_trl_models")
    args = ap.parse_args()
    subprocess.run([sys.executable, str(args.b / "benchmarks" / "vs_trl.py"), "--build",
                    args.root], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(args.b)})
    print(f"# A={args.a} B={args.b} reps={args.reps} steps={args.steps} "
          f"threads={args.threads}; load {os.getloadavg()[0]:.2f}")
    print("| work | setting | A s/step | B s/step | B/A median (min-max) |")
    print("|---|---|---|---|---|")
    for algo in args.algos:
        for setting in args.settings:
            spec = {"algo": algo, "model": args.model, "framework": "ours", "setting": setting,
                    "warmup": 1, "steps": args.steps, "threads": args.threads,
                    "root": args.root, **({"beta": 0.04, "new_tokens": 32}
                                          if algo == "grpo" else {})}
            a, b = [], []
            for _ in range(args.reps):
                a.append(run(args.a, spec))
                b.append(run(args.b, spec))
            ratios = [y / x for x, y in zip(a, b, strict=True)]
            print(f"| {algo} {args.model} | {setting} | {statistics.median(a):.3f} | "
                  f"{statistics.median(b):.3f} | {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}) |", flush=True)
    print(f"# load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
