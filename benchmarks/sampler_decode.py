"""The bf16 sampler copy's decode attention, A against B in one process: one generation of the
`vs_trl.py` GRPO work (8 prompts x 8 samples, per-sequence seeds) with the KV cache in bf16 and
PyTorch's bf16 attention kernel (what an AMX CPU keeps) against the fp32 cache and fp32 kernel
(what a CPU without AMX gets), alternating, after one warm-up of each.

    OMP_NUM_THREADS=2 python benchmarks/sampler_decode.py --threads 2 --new-tokens 32 128

Prints, per length, the median seconds of each and the median of the paired ratios. The models
are `vs_trl.py`'s (built under --root when missing). `--trainer-steps K` also times whole GRPO
steps of that work (`bf16_compute`, k3 KL 0.04) in one trainer, the two set-ups alternating
step by step, K each after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.bf16_copy import DECODE_ATTENTION, BF16SamplingCopy
from posttrain.rollout import SamplingParams, generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402

MODES = ("bf16 cache", "fp32 cache")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/vs_trl_models")
    ap.add_argument("--model", default="19M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trainer-steps", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.root)
    if not (root / args.model / "config.json").exists():
        vs_trl.build(root)
    model = AutoModelForCausalLM.from_pretrained(root / args.model)
    tok = AutoTokenizer.from_pretrained(root / args.model)
    sampler = BF16SamplingCopy(model)
    if sampler.model.config._attn_implementation != DECODE_ATTENTION:
        print("# note: this CPU keeps the bf16 cache by default (AMX, or not a CPU run)")
    rows = [json.loads(x) for x in (root / "prompts.jsonl").read_text().splitlines()][:8]
    prompts = [r["prompt"] + "\n" for r in rows]
    for new in args.new_tokens:
        params = SamplingParams(max_new_tokens=new)
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        tokens: dict[str, int] = {}
        for rep in range(args.reps + 1):
            for mode in MODES:
                sampler.fp32_kv_cache(mode == "fp32 cache")
                t0 = time.perf_counter()
                out = generate(sampler.model, tok, prompts, group_size=8, params=params,
                               seeds=list(range(64)))
                if rep:  # the first round warms up
                    seconds[mode].append(time.perf_counter() - t0)
                tokens[mode] = int(out.response_mask.sum())
        a, b = (statistics.median(seconds[m]) for m in MODES)
        pairs = [x / y for x, y in zip(*seconds.values(), strict=True)]
        print(f"{new} new tokens: {MODES[0]} {a:.3f} s, {MODES[1]} {b:.3f} s; paired ratio "
              f"median {statistics.median(pairs):.3f} (min {min(pairs):.3f}, max "
              f"{max(pairs):.3f}); tokens {tokens[MODES[0]]} / {tokens[MODES[1]]}")
        if args.trainer_steps:
            trainer_steps(root / args.model, root, new, args.threads, args.trainer_steps)


def trainer_steps(model_dir: Path, root: Path, new: int, threads: int, steps: int) -> None:
    """Whole GRPO steps in one trainer, the sampler's two set-ups alternating step by step."""
    import tempfile

    from posttrain.config import GRPOConfig, build_config
    from posttrain.trainers.grpo import GRPOTrainer

    cfg = build_config(GRPOConfig, overrides={
        "model": str(model_dir), "train_data": str(root / "prompts.jsonl"),
        "out_dir": tempfile.mkdtemp(prefix="sampler_decode_"), "threads": threads,
        "rewards": [{"name": "vs_trl:parity_reward"}], "group_size": 8, "prompts_per_step": 8,
        "max_new_tokens": new, "kl_coef": 0.04, "kl_estimator": "k3", "lr": 1e-6,
        "micro_batch_size": 64, "autocast_bf16": True, "bf16_compute": True,
        "max_steps": 2 * steps + 1, "progress": False})
    trainer = GRPOTrainer(cfg)
    trainer.step(1)  # warm-up; builds the sampler copy
    sampler = trainer.sync_sampler()._copy  # the sampler's BF16SamplingCopy
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(steps):
        for j, mode in enumerate(MODES):
            sampler.fp32_kv_cache(mode == "fp32 cache")
            t0 = time.perf_counter()
            trainer.step(2 + 2 * i + j)
            seconds[mode].append(time.perf_counter() - t0)
    pairs = [x / y for x, y in zip(*seconds.values(), strict=True)]
    print(f"  GRPO steps, {new} new tokens: " + ", ".join(
        f"{m} {statistics.median(v):.3f} s" for m, v in seconds.items())
        + f"; paired ratio median {statistics.median(pairs):.3f} (min {min(pairs):.3f}, "
        f"max {max(pairs):.3f})")


if __name__ == "__main__":
    main()
