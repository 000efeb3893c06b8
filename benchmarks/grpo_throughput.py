"""GRPO step throughput: seconds per step, completion tokens/s (generation and training phases
separately) and peak RSS, for the settings of issue 3:

    G=8 samples x 8 prompts per step, 32 new tokens, 16-token prompts, a character vocabulary,
    kl_coef 0.04 (reference forward pass) and 0 (none), fp32 and bf16 autocast, on two Llamas:
    0.55M (hidden 128, 2 layers, 4 heads, MLP 512) and 19M (hidden 512, 6 layers, 8 heads,
    MLP 1376).

Each configuration runs in its own process (so peak RSS is its own), does `--warmup` steps, then
`--steps` timed steps; the table reports medians. The reward is a trivial length-free function
(no verifier cost), the model is randomly initialised (so it rarely stops before 32 tokens;
the mean completion length is printed). Usage:

    python benchmarks/grpo_throughput.py                 # all configurations
    python benchmarks/grpo_throughput.py --models 0.55M --threads 2 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "0.55M": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512},
    "19M": {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "intermediate_size": 1376},
}


def constant_reward(completion: str) -> float:
    """Half the sequences of a group score 1: non-zero advantages, no verifier cost."""
    return float(len(completion) % 2)


def run_one(model_name: str, kl_coef: float, bf16: bool, threads: int, steps: int,
            warmup: int) -> dict:
    import torch

    from posttrain.config import GRPOConfig, build_config
    from posttrain.core.io import peak_rss_mb
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer
    from posttrain.trainers.grpo import GRPOTrainer

    torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, **MODELS[model_name], seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    save_checkpoint(model, tok, root / "model")
    rng = random.Random(0)
    alphabet = "0123456789+-*="
    with (root / "prompts.jsonl").open("w") as fh:
        for _ in range(512):  # 15 characters + the template's newline/BOS = 16-17 tokens
            fh.write(json.dumps({"prompt": "".join(rng.choices(alphabet, k=15)),
                                 "answer": "0"}) + "\n")
    cfg = build_config(GRPOConfig, overrides={
        "model": str(root / "model"), "train_data": str(root / "prompts.jsonl"),
        "out_dir": str(root / "out"), "rewards": [{"name": f"{__name__}:constant_reward"}],
        "group_size": 8, "prompts_per_step": 8, "max_new_tokens": 32, "kl_coef": kl_coef,
        "autocast_bf16": bf16, "max_steps": warmup + steps, "threads": threads,
        "progress": False, "lr": 1e-6, "micro_batch_size": 64})
    trainer = GRPOTrainer(cfg)
    prompt_tokens = len(tok(trainer.session.render(trainer.session.train_rows[0]["prompt"]),
                            add_special_tokens=False)["input_ids"])
    start = time.time()
    trainer.train()
    rows = [json.loads(x) for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_seconds" in r][warmup:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {"model": model_name, "params_m": round(n_params / 1e6, 2), "kl_coef": kl_coef,
            "bf16": bf16, "threads": threads, "prompt_tokens": prompt_tokens,
            "s_per_step": med("perf/step_seconds"), "gen_s": med("perf/gen_seconds"),
            "train_s": med("perf/train_seconds"),
            "gen_tok_s": med("perf/gen_tokens_per_sec"),
            "train_tok_s": med("perf/train_tokens_per_sec"),
            "completion_len": med("response/length_mean"),
            "peak_rss_mb": round(peak_rss_mb(), 0), "wall_s": round(time.time() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--kl", nargs="+", type=float, default=[0.04, 0.0])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(run_one(**spec)))
        return
    print(f"# grpo_throughput: threads={args.threads} steps={args.steps} (median) "
          f"warmup={args.warmup}; load before: {os.getloadavg()[0]:.2f}")
    header = ("model", "kl", "prec", "s/step", "gen s", "train s", "gen tok/s", "train tok/s",
              "len", "peak RSS MB")
    print(" | ".join(header))
    for name in args.models:
        for kl in args.kl:
            for prec in args.precision:
                spec = {"model_name": name, "kl_coef": kl, "bf16": prec == "bf16",
                        "threads": args.threads, "steps": args.steps, "warmup": args.warmup}
                out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                                     capture_output=True, text=True, check=True,
                                     cwd=Path(__file__).resolve().parents[1])
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(" | ".join([
                    name, f"{kl:g}", prec, f"{r['s_per_step']:.3f}", f"{r['gen_s']:.3f}",
                    f"{r['train_s']:.3f}", f"{r['gen_tok_s']:.0f}", f"{r['train_tok_s']:.0f}",
                    f"{r['completion_len']:.1f}", f"{r['peak_rss_mb']:.0f}"]), flush=True)
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
