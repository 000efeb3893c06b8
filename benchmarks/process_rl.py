"""Outcome vs process supervision vs PRM + RLVR in GRPO, from scratch, on the demo task.

    python benchmarks/process_rl.py --out runs/process_rl            # 3 seeds
    python benchmarks/process_rl.py --quick --out runs/process_rl_q  # 1 seed, 300 eval problems

1. the demo world and SFT start (`posttrain demo`'s settings; `--demo DIR` reuses one built by
   `posttrain demo --out DIR`: DIR/sft/final and DIR/data);
2. exact step labels for the SFT policy's own samples (`posttrain.tasks.step_labels`);
3. the PRM (`posttrain prm`, recipes/prm_arith.yaml): its time, peak memory and held-out
   bad-step F1 are the PRM's cost;
4. three GRPO arms from the same SFT start with the same budget (the settings of
   recipes/grpo_process.yaml): `outcome` (math + format rewards, advantage grpo), `process`
   (PRM step scores only, advantage grpo_process, verifier weight 0) and `prm_rlvr`
   (recipes/grpo_prm_rlvr.yaml: outcome advantage + process_weight * process advantage).

Writes DIR/results.json ``{"outcome": {"before", "after", "seconds", ...}, "process": {...},
"prm_rlvr": {...}, "prm": {...}, "setup_seconds": {...}}`` (held-out greedy accuracy in [0, 1],
means over seeds; per-seed values, the accuracy curve, steps and seconds to 90% beside them) and
DIR/process_rl.png (held-out accuracy per step; verifier accuracy vs PRM score during training).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's posttrain, not an installed one
ARMS = ("outcome", "process", "prm_rlvr")
TARGET = 0.9


def build_sft(out: Path, seed: int, threads: int = 0) -> dict[str, str]:
    """The demo's world and SFT warm start (posttrain.demo settings) under `out`; `threads`
    0: the demo's (2)."""
    from posttrain.config import SFTConfig, build_config
    from posttrain.core.io import finished
    from posttrain.demo import _settings, build_world
    from posttrain.trainers.sft import SFTTrainer

    s = _settings(False)
    paths = build_world(out, seed, s)
    keys = {k: v for k, v in s["sft"].items() if k not in ("rows", "flaw_rate")}
    cfg = build_config(SFTConfig, overrides={
        "model": str(out / "init"), "out_dir": str(out / "sft"), "train_data": paths["sft"],
        "seed": seed, "max_seq_len": 128, "threads": threads or s["threads"], "progress": False,
        **keys})
    finished(SFTTrainer(cfg).train(), "the SFT stage")  # a stopped run has no final/
    return {"sft": str(out / "sft" / "final"), "data": str(out / "data")}


def build_labels(sft: str, out: Path, prompts: int, heldout: int, seed: int) -> dict[str, Any]:
    """Exact step labels for the SFT policy's own samples (4 per prompt)."""
    from posttrain.models import load_model_and_tokenizer
    from posttrain.tasks.arithmetic import write_jsonl
    from posttrain.tasks.step_labels import exact_rows

    model, tok = load_model_and_tokenizer(sft)
    out.mkdir(parents=True, exist_ok=True)
    stats = {}
    for split, n in (("train", prompts), ("heldout", heldout)):
        rows = exact_rows(model, tok, n, seed, split=split, samples=4)
        write_jsonl(rows, out / f"exact_{split}.jsonl")
        stats[f"{split}_rows"] = len(rows)
    return stats


def train_prm(sft: str, steps_dir: Path, out: Path, max_steps: int) -> dict[str, Any]:
    """The PRM of recipes/prm_arith.yaml on the exact labels; returns its summary."""
    from posttrain.config import build_config
    from posttrain.core.io import finished
    from posttrain.trainers.prm import PRMConfig, PRMTrainer

    cfg = build_config(PRMConfig, str(ROOT / "recipes" / "prm_arith.yaml"), [
        f"model={sft}", f"out_dir={out}", f"train_data={steps_dir / 'exact_train.jsonl'}",
        f"eval_data={steps_dir / 'exact_heldout.jsonl'}", f"max_steps={max_steps}",
        "eval_every=0", "eval_size=600", "progress=false", "threads=1"])
    return finished(PRMTrainer(cfg).train(), "the PRM stage")


def arm_overrides(arm: str, sft: str, data: str, prm: str, out: Path, seed: int,
                  quick: bool, steps: int) -> dict[str, Any]:
    """One arm's config: recipes/grpo_process.yaml's budget, the arm's rewards/advantage."""
    keys: dict[str, Any] = {
        "model": sft, "train_data": f"{data}/prompts.jsonl", "eval_data": f"{data}/heldout.jsonl",
        "out_dir": str(out), "seed": seed, "progress": False, "eval_every": 10,
        "eval_size": 300 if quick else 1000, "process_reward_model": prm, "max_steps": steps}
    if arm == "outcome":
        keys.update({"advantage": "grpo", "process_reward_model": "",
                     "rewards": [{"name": "math", "weight": 1.0},
                                 {"name": "format", "weight": 1.0}]})
    return keys


def run_arm(arm: str, keys: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from posttrain.config import GRPOConfig, build_config
    from posttrain.trainers.grpo import GRPOTrainer

    recipe = "grpo_prm_rlvr.yaml" if arm == "prm_rlvr" else "grpo_process.yaml"
    cfg = build_config(GRPOConfig, str(ROOT / "recipes" / recipe), overrides=keys)
    summary = GRPOTrainer(cfg).train()
    return {**summary, **curves(Path(cfg.out_dir) / "metrics.jsonl")}


def curves(metrics: Path) -> dict[str, Any]:
    """Held-out accuracy per step, steps/seconds to TARGET, and the reward-hacking watch."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    start = rows[0]["time"]
    acc = [(r["step"], r["eval/accuracy"], r["time"] - start) for r in rows
           if "eval/accuracy" in r]
    hit = next(((s, t) for s, a, t in acc if a >= TARGET), (None, None))
    # the verifier's accuracy on the training samples (outcome arm: its math reward, 0/1)
    watch = [(r["step"], r.get("reward/verifier_accuracy", r.get("reward/math_mean")),
              r.get("process/step_score_mean")) for r in rows if "reward/mean" in r]
    return {"curve": [[s, a] for s, a, _ in acc], "steps_to_90": hit[0],
            "seconds_to_90": None if hit[1] is None else round(hit[1], 1), "watch": watch}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def aggregate(runs: list[dict[str, Any]], extra_seconds: float) -> dict[str, Any]:
    """Means over seeds + per-seed values; `seconds_with_prm` adds labels + PRM training."""
    return {"before": mean([r["eval_before"] for r in runs]),
            "after": mean([r["eval_after"] for r in runs]),
            "seconds": mean([r["seconds"] for r in runs]),
            "seconds_with_prm": round(mean([r["seconds"] for r in runs]) + extra_seconds, 1),
            "per_seed": [{k: r[k] for k in ("eval_before", "eval_after", "seconds",
                                            "steps_to_90", "seconds_to_90")} for r in runs],
            "curves": [r["curve"] for r in runs], "watch": [r["watch"] for r in runs]}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in ARMS:
        for k, curve in enumerate(results[arm]["curves"]):
            ax.plot([s for s, _ in curve], [a for _, a in curve], label=arm if k == 0 else None,
                    color={"outcome": "C0", "process": "C1", "prm_rlvr": "C2"}[arm], alpha=0.8)
        watch = [[float("nan") if v is None else v for v in w] for w in results[arm]["watch"][0]]
        bx.plot([w[0] for w in watch], [w[1] for w in watch], label=f"{arm}: verifier acc",
                color={"outcome": "C0", "process": "C1", "prm_rlvr": "C2"}[arm])
        if watch and watch[0][2] == watch[0][2]:  # not NaN: the arm has a PRM
            bx.plot([w[0] for w in watch], [w[2] for w in watch], linestyle="--",
                    label=f"{arm}: PRM step score", color={"process": "C1", "prm_rlvr": "C2"}[arm])
    ax.axhline(TARGET, color="grey", linewidth=0.5)
    ax.set(xlabel="GRPO step", ylabel="held-out greedy accuracy", title="held-out accuracy")
    bx.set(xlabel="GRPO step", ylabel="training samples (seed 0)",
           title="verifier accuracy vs PRM score")
    ax.legend()
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_prm(sft: str, out: Path, args: argparse.Namespace, setup: dict[str, float]
              ) -> dict[str, Any]:
    """Step labels + PRM under `out`; their seconds go into `setup`; returns the PRM's cost."""
    t = time.time()
    labels = build_labels(sft, out / "steps", args.label_prompts, 150, 0)
    setup["labels"] = round(time.time() - t, 1)
    t = time.time()
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # its own process, so that its peak RSS is the PRM's own and not the SFT's or the labels'
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        prm = pool.submit(train_prm, sft, out / "steps", out / "prm", args.prm_steps).result()
    setup["prm"] = round(time.time() - t, 1)
    info = {"seconds": setup["prm"], "label_seconds": setup["labels"], **labels,
            "peak_rss_mb": prm.get("peak_rss_mb"), "step_accuracy": prm.get("eval_after"),
            **{k: v for k, v in (prm.get("eval_after_detail") or {}).items()
               if isinstance(v, (int, float))}}
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="1 seed, 300 held-out problems")
    ap.add_argument("--demo", default="", help="reuse `posttrain demo --out DIR`'s SFT + data")
    ap.add_argument("--seeds", type=int, default=0, help="default 3 (quick: 1)")
    ap.add_argument("--prm-steps", type=int, default=200)
    ap.add_argument("--label-prompts", type=int, default=1000)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=0, help="GRPO steps of every arm "
                    "(default 60; quick: 40)")
    ap.add_argument("--prm", default="", help="reuse a PRM dir (skips labels + PRM training)")
    ap.add_argument("--jobs", type=int, default=1, help="arms run in parallel processes")
    ap.add_argument("--replot", action="store_true", help="only redraw DIR/process_rl.png")
    args = ap.parse_args(argv)
    if args.replot:
        results = json.loads((Path(args.out) / "results.json").read_text())
        for arm in ARMS:  # curves re-read from the runs' metrics.jsonl
            runs = [curves(Path(args.out) / f"{arm}_s{seed}" / "metrics.jsonl")
                    for seed in results["seeds"]]
            results[arm].update(curves=[r["curve"] for r in runs],
                                watch=[r["watch"] for r in runs])
        plot(results, Path(args.out) / "process_rl.png")
        return results
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    setup: dict[str, float] = {}
    t = time.time()
    if args.demo:
        world = {"sft": f"{args.demo}/sft/final", "data": f"{args.demo}/data"}
    else:
        world = build_sft(out / "demo", 0)
        setup["sft"] = round(time.time() - t, 1)
    if args.prm:  # reused: its cost was measured where it was built
        prm_dir, setup["labels"], setup["prm"] = args.prm, 0.0, 0.0
        prm_info: dict[str, Any] = {"reused": args.prm}
    else:
        prm_dir, prm_info = str(out / "prm" / "final"), build_prm(world["sft"], out, args, setup)
    print("[process_rl] PRM:", json.dumps(prm_info), flush=True)
    results: dict[str, Any] = {"prm": prm_info, "setup_seconds": setup, "seeds": seeds,
                               "quick": args.quick}
    arms = args.arms.split(",")
    args.steps = args.steps or (40 if args.quick else 60)
    jobs = [(arm, arm_overrides(arm, world["sft"], world["data"], prm_dir, out / f"{arm}_s{seed}",
                                seed, args.quick, args.steps)) for arm in arms for seed in seeds]
    if args.jobs > 1:  # one process per run, one torch thread each
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            done = list(pool.map(run_arm, *zip(*jobs, strict=True)))
    else:
        done = [run_arm(arm, keys) for arm, keys in jobs]
    for (arm, keys), run in zip(jobs, done, strict=True):
        print(f"[process_rl] {arm} seed {keys['seed']}: {run['eval_before']:.3f} -> "
              f"{run['eval_after']:.3f} in {run['seconds']}s", flush=True)
    for arm in arms:
        runs = [run for (a, _), run in zip(jobs, done, strict=True) if a == arm]
        extra = 0.0 if arm == "outcome" else setup["labels"] + setup["prm"]
        results[arm] = aggregate(runs, extra)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if all(a in results for a in ARMS):
        plot(results, out / "process_rl.png")
    print(json.dumps({a: {k: results[a][k] for k in ("before", "after", "seconds",
                                                     "seconds_with_prm")}
                      for a in ARMS if a in results}, indent=1))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
