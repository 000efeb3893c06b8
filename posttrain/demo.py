"""``posttrain demo``: the offline end-to-end run on the built-in arithmetic task.

1. build a character tokenizer and a tiny Llama locally (nothing is downloaded);
2. write the data: SFT traces with a *systematic* flaw (the minus sign of negative intermediate
   results dropped in most traces), RL prompts, 1,000 held-out problems;
3. SFT warm start -> the model imitates the flaw, so greedy decoding gets every problem with a
   negative intermediate wrong;
4. GRPO with the verifiable math reward (+ format reward) -> RL corrects what imitation taught
   wrong; held-out greedy accuracy is measured before and after;
5. a before/after table, `curves.png` (reward and held-out accuracy over steps) and
   `summary.json` (eval_before, eval_after, seconds, peak_rss_mb).

The same trainers run a real Hugging Face model by changing a recipe's `model:` line; the demo
only adds the local world-building around them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from posttrain.config import GRPOConfig, SFTConfig, build_config
from posttrain.core.io import finished, peak_rss_mb, write_summary
from posttrain.models.loading import save_checkpoint

# The demo's settings, tuned on a 2-core CPU. Threads 0: one per free core. On an otherwise
# idle 2-core AMD EPYC (AVX-512) two threads took 40.2/40.1 s for 300 SFT steps against
# 59.0/61.9 s with one and 10 GRPO steps 4.1/4.1 s against 6.0/5.9 s
# (benchmarks/demo_threads.py); beside other work two run several times slower than one
# (benchmarks/busy_threads.py).
DEMO = {
    "threads": 0,
    "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512},
    "sft": {"rows": 96_000, "flaw_rate": 0.6, "max_steps": 1500, "batch_size": 64, "lr": 2e-3,
            "warmup_steps": 100, "micro_batch_size": 0},  # CPU sizes (the defaults: a GPU's)
    "grpo": {"max_steps": 60, "prompts_per_step": 16, "group_size": 8, "lr": 5e-5,
             "max_new_tokens": 48, "eval_max_new_tokens": 48, "eval_every": 20,
             "micro_batch_size": 64},
    "heldout": 1000,
}
QUICK = {"sft": {"rows": 2000, "max_steps": 30}, "grpo": {"max_steps": 3, "eval_every": 0},
         "heldout": 100}


def _settings(quick: bool) -> dict[str, Any]:
    s = {k: (dict(v) if isinstance(v, dict) else v) for k, v in DEMO.items()}
    if quick:
        for k, v in QUICK.items():
            if isinstance(v, dict):
                s[k].update(v)
            else:
                s[k] = v
    return s


def build_world(out: Path, seed: int, s: dict[str, Any]) -> dict[str, str]:
    """Tokenizer + tiny model + data files under `out`; returns their paths."""
    from posttrain.tasks.arithmetic import heldout_rows, prompt_rows, sft_rows, write_jsonl
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, **s["model"], seed=seed)
    save_checkpoint(model, tok, out / "init")
    data = out / "data"
    paths = {
        "sft": str(write_jsonl(sft_rows(s["sft"]["rows"], seed, flaw_rate=s["sft"]["flaw_rate"]),
                               data / "sft.jsonl")),
        "prompts": str(write_jsonl(prompt_rows(20_000, seed + 1), data / "prompts.jsonl")),
        "heldout": str(write_jsonl(heldout_rows(s["heldout"]), data / "heldout.jsonl")),
    }
    return paths


def run_demo(out_dir: str, seed: int = 0, quick: bool = False) -> dict[str, Any]:
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.sft import SFTTrainer

    start = time.time()
    out, s = Path(out_dir), _settings(quick)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] 1/4 building tokenizer, tiny Llama and data in {out}")
    paths = build_world(out, seed, s)
    sft_keys = {k: v for k, v in s["sft"].items() if k not in ("rows", "flaw_rate")}
    sft_cfg = build_config(SFTConfig, overrides={
        "model": str(out / "init"), "out_dir": str(out / "sft"), "train_data": paths["sft"],
        "seed": seed, "max_seq_len": 128, "threads": s["threads"],
        "overwrite": True, **sft_keys})  # the demo rebuilds its world: a rerun starts afresh
    print(f"[demo] 2/4 SFT warm start ({sft_cfg.max_steps} steps on flawed traces)")
    sft = finished(SFTTrainer(sft_cfg).train(), "the SFT warm start")  # GRPO loads sft/final
    grpo_cfg = build_config(GRPOConfig, overrides={
        "model": str(out / "sft" / "final"), "out_dir": str(out / "grpo"),
        "train_data": paths["prompts"], "eval_data": paths["heldout"],
        "eval_size": s["heldout"], "seed": seed, "threads": s["threads"],
        "overwrite": True, **s["grpo"]})
    print(f"[demo] 3/4 GRPO ({grpo_cfg.max_steps} steps, G={grpo_cfg.group_size}) with the "
          "verifiable math reward")
    grpo = finished(GRPOTrainer(grpo_cfg).train(), "GRPO")
    print("[demo] 4/4 results")
    before, after = grpo["eval_before_detail"], grpo["eval_after_detail"]
    for detail, name in ((before, "eval_before.jsonl"), (after, "eval_after.jsonl")):
        detail.update(_split_by_negative(out / "grpo" / name))
    _print_table(before, after)
    _plot(out / "grpo" / "metrics.jsonl", out / "curves.png")
    summary = {
        "eval_before": before.get("accuracy"), "eval_after": after.get("accuracy"),
        "format_before": before.get("format_rate"), "format_after": after.get("format_rate"),
        "accuracy_with_negative": [before["acc_with_negative"], after["acc_with_negative"]],
        "accuracy_without_negative": [before["acc_without_negative"],
                                      after["acc_without_negative"]],
        "heldout_n": before.get("n"), "seconds": round(time.time() - start, 1),
        "sft_seconds": sft["seconds"], "grpo_seconds": grpo["seconds"],
        "model": str(out / "grpo" / "final"), "peak_rss_mb": round(peak_rss_mb(), 1),
        "quick": quick,
    }
    write_summary(out, None, **summary)
    print(json.dumps({k: summary[k] for k in ("eval_before", "eval_after", "seconds",
                                               "peak_rss_mb")}))
    print(f"wrote {out / 'summary.json'} and {out / 'curves.png'}")
    return summary


def _print_table(before: dict[str, Any], after: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="held-out greedy evaluation")
    table.add_column("metric")
    table.add_column("SFT (before)", justify="right")
    table.add_column("GRPO (after)", justify="right")
    for key in ("accuracy", "acc_with_negative", "acc_without_negative", "format_rate",
                "reward_mean", "length_mean", "n"):
        if key in before:
            fmt = "{:.0f}" if key == "n" else "{:.3f}"
            table.add_row(key, fmt.format(before[key]), fmt.format(after.get(key, float("nan"))))
    Console().print(table)


def _moving_average(values: list[float], k: int) -> list[float]:
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1])
            for i in range(len(values))]


def _split_by_negative(eval_jsonl: Path) -> dict[str, float]:
    """Held-out accuracy on problems with / without a negative intermediate result."""
    from posttrain.tasks.arithmetic import parse_problem

    groups: dict[bool, list[bool]] = {True: [], False: []}
    for line in eval_jsonl.read_text().splitlines():
        row = json.loads(line)
        groups[parse_problem(row["prompt"]).has_negative].append(bool(row["correct"]))
    return {f"acc_{'with' if neg else 'without'}_negative": sum(v) / max(1, len(v))
            for neg, v in groups.items()}


def _plot(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows if "reward/mean" in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    for key, label in (("reward/mean", "reward"), ("reward/accuracy", "sample accuracy")):
        values = [r[key] for r in rows if "reward/mean" in r]
        ax[0].plot(steps, values, alpha=0.3)
        ax[0].plot(steps, _moving_average(values, 8), label=f"{label} (moving avg of 8)")
    ax[0].set_xlabel("GRPO step")
    ax[0].legend()
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if ev:
        ax[1].plot(*zip(*ev, strict=True), marker="o")
    ax[1].set_xlabel("GRPO step")
    ax[1].set_ylabel("held-out greedy accuracy")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
