"""Proxy reward vs gold score over PPO steps (the Gao et al. 2022, arXiv:2210.10760, picture).

Reads a run's `metrics.jsonl` (e.g. from `recipes/ppo_rm_arith.yaml`, which trains on a
`reward_model` entry while a weight-0 `math` entry keeps scoring) and plots the proxy
(`reward/reward_model_mean`), the verifier's mean on the training samples
(`reward/math_mean`) and held-out greedy accuracy (`eval/accuracy`) against the step, plus the
KL to the reference on a second axis. Usage:

    python benchmarks/overoptimisation_plot.py runs/ppo_rm/metrics.jsonl --out docs/ppo_rm.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", help="metrics.jsonl of the run")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--proxy", default="reward/reward_model_mean")
    parser.add_argument("--gold", default="reward/math_mean")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in Path(args.metrics).read_text().splitlines() if x.strip()]
    train = [r for r in rows if args.proxy in r]
    if not train:
        raise SystemExit(f"{args.metrics}: no '{args.proxy}' metric; is this a learned-reward run?")
    steps = [r["step"] for r in train]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r[args.proxy] for r in train], label=f"proxy: {args.proxy}")
    ax.plot(steps, [r.get(args.gold, float("nan")) for r in train], label=f"gold: {args.gold}")
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if evals:
        ax.plot(*zip(*evals, strict=True), marker="o", label="held-out greedy accuracy")
    ax.set_xlabel("PPO step")
    ax.legend(loc="lower left", fontsize=8)
    kl = [(r["step"], r["kl/mean"]) for r in train if "kl/mean" in r]
    if kl:
        ax2 = ax.twinx()
        ax2.plot(*zip(*kl, strict=True), color="grey", linestyle=":", label="KL to reference")
        ax2.set_ylabel("KL per sequence (nats)")
        ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
