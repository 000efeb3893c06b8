"""Pad fraction and step time of a GRPO step, padded vs token-budget vs packed (issue 61).

    OMP_NUM_THREADS=2 python benchmarks/padding_free.py --threads 2 --steps 3 \
        [--mix demo longtail] [--budget 4096] [--hidden 256 --layers 4]

One process, one tiny Llama (char vocabulary; --hidden / --layers), one GRPOTrainer per setting
on the same work, the settings alternating step by step so load drifts hit all alike. The
step's generation is replaced by a fixed synthetic rollout (G=8 x 8 prompts; rewards drawn at
random), so what is timed is the rest of the GRPO step: the reference's no-grad log-probs
(kl_coef 0.04, k3 in the loss) and the update (one optimizer step): the part padding costs.
Mixes: `demo` (15-20-token prompts, 25-40-token completions, like the arithmetic demo) and
`longtail` (completion lengths from a log-normal, median 64, clipped to 16-1,024: a few
1,024-token rows among short ones). Settings: `padded` (micro_batch_size 8, rows sorted by
length: the default), `padded64` (one micro-batch of all 64 rows), `budget`
(micro_batch_tokens), `packed` (packing + micro_batch_tokens).
Prints one row per mix and setting: median s/step, pad fraction, speed-up against padded.
On a GPU: the same command with --device cuda (flash attention's varlen kernel where the model
loads with attn_implementation=flash_attention_2; sdpa with a block mask otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.config import GRPOConfig, build_config  # noqa: E402
from posttrain.engine.update import padded_step  # noqa: E402
from posttrain.models.loading import save_checkpoint  # noqa: E402
from posttrain.rollout.record import Rollout  # noqa: E402
from posttrain.tasks.tiny import build_tiny_llama  # noqa: E402
from posttrain.tasks.tokenizer import build_char_tokenizer  # noqa: E402
from posttrain.trainers.grpo import GRPOTrainer  # noqa: E402

G, PROMPTS = 8, 8


def lengths(mix: str, n: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(prompt lengths, completion lengths) of n rows of `mix`."""
    prompts = torch.randint(15, 21, (n,), generator=gen).tolist()
    if mix == "demo":
        return prompts, torch.randint(25, 41, (n,), generator=gen).tolist()
    normal = torch.randn(n, generator=gen)
    tail = (torch.log(torch.tensor(64.0)) + 1.0 * normal).exp()  # log-normal, median 64
    return prompts, tail.clamp(16, 1024).round().long().tolist()


def synthetic_rollout(mix: str, vocab: int, pad: int, seed: int) -> Rollout:
    """A G x PROMPTS rollout of `mix`: prompts left padded, completions right padded."""
    gen = torch.Generator().manual_seed(seed)
    n = G * PROMPTS
    p_len, c_len = lengths(mix, n, gen)
    P, T = max(p_len), max(c_len)
    p_mask = torch.arange(P).flip(0)[None] < torch.tensor(p_len)[:, None]  # [n, P]
    c_mask = torch.arange(T)[None] < torch.tensor(c_len)[:, None]  # [n, T]
    p_ids = torch.where(p_mask, torch.randint(3, vocab, (n, P), generator=gen), pad)
    c_ids = torch.where(c_mask, torch.randint(3, vocab, (n, T), generator=gen), pad)
    return Rollout(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids,
                   response_mask=c_mask, logprobs=torch.zeros(n, T),
                   truncated=torch.zeros(n, dtype=torch.bool), group_size=G,
                   scores=torch.rand(n, generator=gen))


def trainer(setting: str, root: Path, args: argparse.Namespace, rollout: Rollout) -> GRPOTrainer:
    keys = {"model": str(root / "model"), "train_data": str(root / "prompts.jsonl"),
            "out_dir": str(root / f"out_{setting}"), "rewards": [{"name": "math"}],
            "group_size": G, "prompts_per_step": PROMPTS, "max_new_tokens": 1024,
            "kl_coef": 0.04, "kl_estimator": "k3", "lr": 1e-6, "threads": args.threads,
            "progress": False, "report_to": [],
            "micro_batch_size": 64 if setting == "padded64" else 8,
            "device": args.device, "save_every": 0}
    if not setting.startswith("padded"):
        keys["micro_batch_tokens"] = args.budget
    if setting == "packed":
        keys["packing"] = True
    t = GRPOTrainer(build_config(GRPOConfig, overrides=keys))
    t.model.train()

    def fixed_rollout() -> tuple[Rollout, dict[str, float]]:
        return rollout.select(torch.arange(rollout.num_sequences)), {
            "_gen_tokens": float(rollout.response_mask.sum())}

    t.rollout_step = fixed_rollout  # the step's generation: this fixed rollout
    return t


def build(root: Path, args: argparse.Namespace) -> int:
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=args.hidden, num_layers=args.layers,
                             num_heads=max(1, args.hidden // 64),
                             intermediate_size=4 * args.hidden, max_position_embeddings=1088)
    save_checkpoint(model, tok, root / "model")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    return len(tok)


def run_mix(mix: str, root: Path, args: argparse.Namespace, vocab: int, pad: int) -> None:
    rollout = synthetic_rollout(mix, vocab, pad, seed=0)
    trainers = {s: trainer(s, root, args, rollout) for s in args.settings}
    times: dict[str, list[float]] = {s: [] for s in trainers}
    pads: dict[str, float] = {}
    for step in range(1, args.warmup + args.steps + 1):
        for s, t in trainers.items():  # alternating: drifts in load hit every setting
            t0 = time.perf_counter()
            metrics = padded_step(t.step, step, t.dist)
            if step > args.warmup:
                times[s].append(time.perf_counter() - t0)
            pads[s] = metrics["perf/pad_fraction"]
    widths = rollout.prompt_mask.sum(-1) + rollout.response_mask.sum(-1)
    print(f"| {mix} ({G * PROMPTS} rows, widths {int(widths.min())}-{int(widths.max())}, "
          f"mean {float(widths.float().mean()):.0f}) | s/step (median) | pad fraction | "
          "speed-up vs padded |")
    base = statistics.median(times["padded"]) if "padded" in times else None
    for s in trainers:
        med = statistics.median(times[s])
        ratio = f"{base / med:.2f}x" if base else ""
        print(f"| {s} | {med:.3f} | {pads[s]:.1%} | {ratio} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", nargs="+", default=["demo", "longtail"], choices=["demo", "longtail"])
    ap.add_argument("--settings", nargs="+", default=["padded", "padded64", "budget", "packed"],
                    choices=["padded", "padded64", "budget", "packed"])
    ap.add_argument("--budget", type=int, default=4096, help="micro_batch_tokens")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# padding_free: {platform.processor() or platform.machine()}, threads "
          f"{args.threads}, hidden {args.hidden} x {args.layers} layers, budget {args.budget}, "
          f"steps {args.steps} (+{args.warmup} warm-up); load {os.getloadavg()[0]:.2f}")
    root = Path(tempfile.mkdtemp(prefix="padding_free_"))
    vocab = build(root, args)
    pad = build_char_tokenizer().pad_token_id
    for mix in args.mix:
        run_mix(mix, root, args, vocab, pad)
    print(f"# load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
