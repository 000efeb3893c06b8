"""The demo's two phases at 1 and 2 torch threads, side by side (the demo's `threads` setting).

    posttrain demo --out runs/demo            # once: the world (init model, data, SFT model)
    python benchmarks/demo_threads.py --world runs/demo [--sft-steps 300] [--grpo-steps 10]

Runs the demo's SFT settings for `--sft-steps` steps from the demo's initial model and its GRPO
settings for `--grpo-steps` steps from its SFT model (no evaluation), at threads 1 then 2,
`--reps` times interleaved, and prints the seconds of each run. Run it on an otherwise idle
machine: two threads on a busy 2-core machine stall each other.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from posttrain.config import GRPOConfig, SFTConfig, build_config
from posttrain.demo import DEMO
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.sft import SFTTrainer


def sft_seconds(world: Path, threads: int, steps: int, out: Path) -> float:
    keys = {k: v for k, v in DEMO["sft"].items() if k not in ("rows", "flaw_rate")}
    keys.update(max_steps=steps, warmup_steps=min(steps // 10, keys["warmup_steps"]))
    cfg = build_config(SFTConfig, overrides={
        "model": str(world / "init"), "out_dir": str(out), "train_data": str(
            world / "data" / "sft.jsonl"), "seed": 0, "max_seq_len": 128, "threads": threads,
        "overwrite": True, "progress": False, "report_to": [], **keys})
    start = time.time()
    SFTTrainer(cfg).train()
    return time.time() - start


def grpo_seconds(world: Path, threads: int, steps: int, out: Path) -> float:
    keys = {**DEMO["grpo"], "max_steps": steps, "eval_every": 0}
    cfg = build_config(GRPOConfig, overrides={
        "model": str(world / "sft" / "final"), "out_dir": str(out),
        "train_data": str(world / "data" / "prompts.jsonl"), "eval_size": 0, "seed": 0,
        "threads": threads, "overwrite": True, "progress": False, "report_to": [], **keys})
    start = time.time()
    GRPOTrainer(cfg).train()
    return time.time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", default="runs/demo", help="a finished `posttrain demo --out` dir")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--grpo-steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    world, tmp = Path(args.world), Path(tempfile.mkdtemp())
    times: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for threads in (1, 2):
            times.setdefault(f"sft@{threads}", []).append(
                sft_seconds(world, threads, args.sft_steps, tmp / f"sft{threads}"))
            times.setdefault(f"grpo@{threads}", []).append(
                grpo_seconds(world, threads, args.grpo_steps, tmp / f"grpo{threads}"))
    for name, values in times.items():
        print(f"{name}: " + " ".join(f"{v:.1f}" for v in values) + " s")


if __name__ == "__main__":
    main()
