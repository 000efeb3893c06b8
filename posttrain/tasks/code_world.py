"""The offline code world: tiny model + function-synthesis data + SFT warm start.

``python -m posttrain.tasks.code_world --out runs/code`` (or :func:`build_code_world`) writes

1. ``init/``: a character tokenizer and a randomly initialised tiny Llama (nothing downloaded);
2. ``data/sft.jsonl`` (train-split programs, ``flaw_rate`` of them with the missing-parentheses
   bug of :mod:`posttrain.tasks.functions`), ``data/prompts.jsonl`` (train-split code rows for
   RL) and ``data/heldout.jsonl`` (distinct held-out code rows, tests not shown in the prompt);
3. ``sft/final``: the SFT warm start (:class:`posttrain.trainers.sft.SFTTrainer`), the model that
   ``recipes/grpo_code.yaml`` starts from;
4. ``summary.json``: held-out pass rates of the SFT model under greedy decoding and at
   temperature 1 (the gap is the headroom RL can use), the fraction of its programs that carry
   the bug, and the sandbox outcome counters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from posttrain.config import SFTConfig, build_config
from posttrain.core.io import peak_rss_mb, write_summary
from posttrain.models.loading import save_checkpoint

CODE_REWARD = [{"name": "code", "weight": 1.0, "kwargs": {"timeout_s": 2.0}}]

# Tuned on a shared 2-core CPU (load ~7): SFT ~5 minutes at one torch thread.
WORLD: dict[str, Any] = {
    "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512,
              "max_position_embeddings": 128},
    "sft": {"rows": 64_000, "flaw_rate": 0.6, "max_steps": 700, "batch_size": 64, "lr": 3e-3,
            "warmup_steps": 50, "micro_batch_size": 0},  # the whole batch: a CPU size
    "prompts": 20_000,
    "heldout": 1000,
    "measure": 500,
}
QUICK: dict[str, Any] = {"sft": {"rows": 2000, "max_steps": 20}, "prompts": 200, "heldout": 64,
                         "measure": 32}


def world_settings(quick: bool = False) -> dict[str, Any]:
    """A copy of :data:`WORLD`, with :data:`QUICK` applied when ``quick``."""
    s = {k: dict(v) if isinstance(v, dict) else v for k, v in WORLD.items()}
    if quick:
        for key, value in QUICK.items():
            if isinstance(value, dict):
                s[key].update(value)
            else:
                s[key] = value
    return s


def write_world_data(out: Path, seed: int, s: dict[str, Any]) -> dict[str, str]:
    """Tokenizer + tiny model under ``out/init`` and the three data files; returns the paths."""
    from posttrain.tasks.functions import code_rows, heldout_rows, sft_rows, write_jsonl
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_llama(tok, **s["model"], seed=seed), tok, out / "init")
    data = out / "data"
    sft = sft_rows(s["sft"]["rows"], seed, flaw_rate=s["sft"]["flaw_rate"])
    return {
        "init": str(out / "init"),
        "sft": str(write_jsonl(sft, data / "sft.jsonl")),
        "prompts": str(write_jsonl(code_rows(s["prompts"], seed + 1), data / "prompts.jsonl")),
        "heldout": str(write_jsonl(heldout_rows(s["heldout"]), data / "heldout.jsonl")),
    }


def pass_rates(model: Any, tokenizer: Any, rows: list[dict[str, Any]], *,
               temperature: float | None = None, max_new_tokens: int = 40,
               seed: int = 0, batch_size: int = 256) -> dict[str, float]:
    """Held-out pass rate of ``model`` on code rows, one sample per row.

    ``temperature=None`` decodes greedily. Returns ``pass_rate``, ``bug_rate`` (fraction of
    programs with the missing-parentheses bug, ``*x-``), ``n`` and the ``code/*`` counters.
    """
    import torch

    from posttrain.data import render_prompt
    from posttrain.rewards import Rewards, RewardSpec
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.sampler import model_sampler

    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=temperature is None,
                            temperature=temperature or 1.0)
    gen = torch.Generator().manual_seed(seed)
    prompts = [render_prompt(tokenizer, r["prompt"]) for r in rows]
    rollout = model_sampler(model, tokenizer).generate(prompts, rows=rows, params=params,
                                                      generator=gen, batch_size=batch_size)
    result = Rewards([RewardSpec(**spec) for spec in CODE_REWARD]).score(
        rollout.completions, rows)
    n = len(rows)
    out = {"pass_rate": sum(v >= 1.0 for v in result.per_function["code"]) / n,
           "bug_rate": sum("*x-" in c for c in rollout.completions) / n, "n": float(n)}
    out.update({k: v for k, v in result.metrics.items() if k.startswith("code/")})
    return out


def build_code_world(out_dir: str | Path, seed: int = 0, *, quick: bool = False,
                     threads: int = 1, progress: bool = True) -> dict[str, Any]:
    """Build the world under ``out_dir`` and run the SFT warm start; returns the summary.

    The summary (also ``out_dir/summary.json``) holds the data paths, the SFT model path,
    ``sft_greedy`` and ``sft_t1`` (:func:`pass_rates` on ``measure`` held-out rows) and timings.
    """
    from posttrain.data import load_rows
    from posttrain.models import load_model_and_tokenizer
    from posttrain.trainers.sft import SFTTrainer

    start, out, s = time.time(), Path(out_dir), world_settings(quick)
    out.mkdir(parents=True, exist_ok=True)
    paths = write_world_data(out, seed, s)
    sft_keys = {k: v for k, v in s["sft"].items() if k not in ("rows", "flaw_rate")}
    cfg = build_config(SFTConfig, overrides={
        "model": paths["init"], "out_dir": str(out / "sft"), "train_data": paths["sft"],
        "seed": seed, "lr_schedule": "cosine", "max_seq_len": 96, "threads": threads,
        "eval_rewards": CODE_REWARD, "progress": progress, **sft_keys})
    sft = SFTTrainer(cfg).train()
    model, tok = load_model_and_tokenizer(str(out / "sft" / "final"))
    rows = load_rows(paths["heldout"], kind="code")[: s["measure"]]
    greedy = pass_rates(model, tok, rows, seed=seed)
    sampled = pass_rates(model, tok, rows, temperature=1.0, seed=seed)
    summary = {"paths": {**paths, "sft_model": str(out / "sft" / "final")},
               "sft_greedy": greedy, "sft_t1": sampled, "sft_loss_last": sft["train"]["loss_last"],
               "sft_seconds": sft["seconds"], "seconds": round(time.time() - start, 1),
               "peak_rss_mb": round(peak_rss_mb(), 1), "quick": quick, "seed": seed,
               "settings": s}
    write_summary(out, None, **summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m posttrain.tasks.code_world",
        description="Build the offline code world (tiny model, function-synthesis data) and run "
                    "its SFT warm start; then: posttrain grpo --config recipes/grpo_code.yaml")
    parser.add_argument("--out", default="runs/code", help="output directory [runs/code]")
    parser.add_argument("--seed", type=int, default=0, help="random seed [0]")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads [1]; 0 keeps torch's default (one per core)")
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    args = parser.parse_args(argv)
    summary = build_code_world(args.out, args.seed, quick=args.quick, threads=args.threads)
    print(json.dumps({"sft_greedy": summary["sft_greedy"]["pass_rate"],
                      "sft_t1": summary["sft_t1"]["pass_rate"],
                      "sft_greedy_bug_rate": summary["sft_greedy"]["bug_rate"],
                      "seconds": summary["seconds"]}))
    print(f"wrote {Path(args.out) / 'summary.json'}; next: posttrain grpo --config "
          f"recipes/grpo_code.yaml")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
