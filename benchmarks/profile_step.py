"""Where a GRPO step spends its time: per-phase wall time and the top operators.

    python benchmarks/profile_step.py --model 19M --steps 3 --threads 1 \
        [--bf16 | --bf16-compute [--compile]] [--ops 15]

Runs our GRPOTrainer on the work of `benchmarks/vs_trl.py` (G=8 x 8 prompts, 32 new tokens or
`--new-tokens`, beta 0.04 k3 in the loss; `--model qwen152k`: 8 samples of one prompt, 256 new
tokens or `--new-tokens`; models built there under --root) and times each phase by wrapping the
functions the trainer calls, each inside a ``torch.profiler.record_function`` label:

    prefill    the first model call of a generation (the prompt, once per distinct prompt)
    decode     every later model call of the generation (one token per running row)
    sampling   the rest of generation (sampling, bookkeeping, detokenisation)
    scoring    reward functions
    reference  the reference model's no-grad log-probs
    policy_fwd the policy forward with grad (log-probs and entropies)
    backward   loss.backward()
    optimizer  clip + optimizer step + scheduler
    other      the rest of the step (advantages, loss math, logging)

Prints one line per phase (median seconds per step over the timed steps after one warm-up
step) and, with --ops, the profiler's top operators by self CPU time over the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vs_trl  # noqa: E402

PHASES = ("prefill", "decode", "sampling", "scoring", "reference", "policy_fwd", "backward",
          "optimizer", "other")


class PhaseClock:
    """Accumulates wall seconds per phase for the current step; nested phases are subtracted."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [name, start, seconds of nested phases] per open phase

    @contextlib.contextmanager
    def phase(self, name: str):
        self.stack.append([name, time.perf_counter(), 0.0])
        with torch.profiler.record_function(name):
            try:
                yield
            finally:
                _, start, inner = self.stack.pop()
                spent = time.perf_counter() - start
                self.now[name] += spent - inner
                if self.stack:
                    self.stack[-1][2] += spent

    def wrap(self, name: str, fn):
        def wrapped(*a, **k):
            with self.phase(name):
                return fn(*a, **k)
        return wrapped


def instrument(trainer, clock: PhaseClock) -> None:
    """Wrap the trainer's collaborators so that each phase is timed."""
    import posttrain.engine.update as engine_mod

    engine = trainer.sync_sampler()
    engine.generate = clock.wrap("sampling", engine.generate)
    trainer.policy_logprobs = clock.wrap("reference", trainer.policy_logprobs)  # old and ref
    trainer.micro_loss = clock.wrap("policy_fwd", trainer.micro_loss)  # forward + loss
    trainer.session.rewards.score = clock.wrap("scoring", trainer.session.rewards.score)
    engine_mod.step_groups = clock.wrap("optimizer", engine_mod.step_groups)
    backward = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *a, **k: clock.wrap("backward", backward)(self, *a, **k)
    sampler, _ = engine.sampling_model()  # the bf16 sampler copy under autocast_bf16
    trainer.learner()  # build the bf16_compute learner copy before the policy is wrapped
    for model in {id(m): m for m in (trainer.model, sampler)}.values():
        model.forward = _timed_forward(model.forward, clock)


def _timed_forward(inner_forward, clock: PhaseClock):
    def forward(*a, **k):
        if clock.stack and clock.stack[0][0] == "sampling" and k.get("use_cache"):  # generation
            first = k.get("input_ids") is not None and k["input_ids"].shape[1] > 1
            with clock.phase("prefill" if first else "decode"):
                return inner_forward(*a, **k)
        return inner_forward(*a, **k)

    return forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/vs_trl_models")
    ap.add_argument("--model", default="19M", choices=[*vs_trl.LLAMAS, "qwen152k"])
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="most new tokens: qwen152k's 8 samples of one prompt (default 256), "
                    "a Llama's 8 x 8 (default 32)")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--bf16", action="store_true", help="autocast_bf16")
    ap.add_argument("--bf16-compute", action="store_true", help="bf16_compute (implies --bf16)")
    ap.add_argument("--compile", action="store_true", help="torch_compile (with --bf16-compute)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ops", type=int, default=0, help="top operators to list (0: none)")
    ap.add_argument("--no-share-prefix", action="store_true",
                    help="share_prompt_prefix: false (every row runs its prompt)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.root)
    if not (root / args.model / "config.json").exists():
        vs_trl.build(root)
    from posttrain.config import GRPOConfig, build_config
    from posttrain.trainers.grpo import GRPOTrainer

    new = args.new_tokens or (256 if args.model == "qwen152k" else 32)
    w = vs_trl._work({"model": args.model, "new_tokens": new})
    cfg = build_config(GRPOConfig, overrides={
        "model": str(root / args.model), "train_data": str(root / "prompts.jsonl"),
        "out_dir": tempfile.mkdtemp(prefix="profile_step_"), "threads": args.threads,
        "rewards": [{"name": "vs_trl:parity_reward"}], "group_size": w["G"],
        "prompts_per_step": w["prompts"], "max_new_tokens": w["new"], "kl_coef": args.beta,
        "kl_estimator": "k3", "lr": 1e-6, "micro_batch_size": w["micro"],
        "autocast_bf16": args.bf16 or args.bf16_compute,
        "bf16_compute": args.bf16_compute, "torch_compile": args.compile, "max_steps": 1,
        "share_prompt_prefix": not args.no_share_prefix,
        "progress": False})
    trainer = GRPOTrainer(cfg)
    clock = PhaseClock()
    instrument(trainer, clock)
    per_step: list[dict[str, float]] = []
    prof = None
    for i in range(args.steps + 1):
        clock.now = defaultdict(float)
        last = i == args.steps and args.ops
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
            if last else None
        with prof or contextlib.nullcontext():
            t0 = time.perf_counter()
            trainer.model.train()
            trainer.step(i)
            total = time.perf_counter() - t0
        phases = dict(clock.now)
        phases["other"] = total - sum(phases.values())
        phases["total"] = total
        if i > 0:  # the first step warms up
            per_step.append(phases)
    print(f"# profile_step: {args.model} beta={args.beta} bf16={args.bf16} "
          f"bf16_compute={args.bf16_compute} compile={args.compile} "
          f"threads={args.threads} steps={args.steps} share_prefix={trainer.forward.share_prefix}")
    total = statistics.median(p["total"] for p in per_step)
    for name in (*PHASES, "total"):
        s = statistics.median(p.get(name, 0.0) for p in per_step)
        print(f"| {name} | {s:.3f} | {100 * s / total:.0f}% |")
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))


if __name__ == "__main__":
    main()
