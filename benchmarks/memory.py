"""Peak memory of GRPO vs PPO (full fine-tuning and LoRA) on the same model and the same batch.

The claim to check (seed note 000, GRPO section): dropping PPO's critic saves about one model's
worth of memory: its weights, gradients and optimizer state. Each arm runs in its own process
(so the peak is its own): build the trainer, run `--steps` training steps, then report

- `peak RSS`: the process's peak resident memory, and `peak - base`: minus the RSS measured just
  before the trainer was built (python, torch and transformers imported), so the interpreter's
  fixed cost does not hide the differences;
- `state`: the bytes of the trainer's model state, counted from the live objects after the
  steps: weights of every distinct parameter (policy, reference copy, critic), the gradients
  backward holds for every trainable parameter (freed after each optimizer step, so counted
  from the parameters) and the AdamW moments.

Arms: GRPO (beta 0.04: a reference copy; beta 0: none), PPO (beta 0.05 / 0; critic = copy of the
policy's body + value head, its own AdamW), and both with LoRA (reference = adapters off; PPO's
critic = a second adapter on the same frozen base). Same model, prompts, N = prompts x G
sequences, `max_new_tokens`, micro-batch; PPO runs 1 epoch x 1 mini-batch so the work per step
matches GRPO's single update. CPU, one process per arm. Usage:

    python benchmarks/memory.py                       # 25M-parameter Llama, 32 sequences
    python benchmarks/memory.py --hidden 256 --layers 4 --steps 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's posttrain

ARMS: dict[str, tuple[str, dict]] = {
    "grpo, beta 0.04": ("grpo", {"kl_coef": 0.04}),
    "grpo, beta 0": ("grpo", {"kl_coef": 0.0}),
    "ppo, beta 0.05": ("ppo", {"kl_coef": 0.05}),
    "ppo, beta 0": ("ppo", {"kl_coef": 0.0}),
    "grpo + LoRA, beta 0.04": ("grpo", {"kl_coef": 0.04, "lora_r": 16}),
    "ppo + LoRA, beta 0.05": ("ppo", {"kl_coef": 0.05, "lora_r": 16}),
}


def current_rss_mb() -> float:
    """Resident memory of this process now (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_world(root: Path, hidden: int, layers: int) -> None:
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=hidden, num_layers=layers,
                             num_heads=max(1, hidden // 64), intermediate_size=hidden * 8 // 3,
                             seed=0)
    save_checkpoint(model, tok, root / "model")
    rows = [{"prompt": f"{i % 97}+{i % 89}=", "answer": str(i % 97 + i % 89)} for i in range(256)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def state_mb(trainer) -> dict[str, float]:
    """Exact bytes held by weights, gradients and optimizer state of the trainer's models."""
    import torch

    modules = [trainer.model, getattr(trainer, "_ref", None), getattr(trainer, "critic", None)]
    params: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in (m.parameters() if m is not None else []):
            params[id(p)] = p
    weights = sum(p.numel() * p.element_size() for p in params.values())
    # gradients are freed after each optimizer step (set_to_none): count what backward holds
    grads = sum(p.numel() * p.element_size() for p in params.values() if p.requires_grad)
    opt_bytes = 0
    for opt in (trainer.opt, getattr(trainer, "critic_opt", None)):
        for state in (opt.state.values() if opt is not None else []):
            opt_bytes += sum(v.numel() * v.element_size() for v in state.values()
                             if isinstance(v, torch.Tensor))
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    mb = 2**20
    return {"weights_mb": weights / mb, "grads_mb": grads / mb, "optimizer_mb": opt_bytes / mb,
            "state_mb": (weights + grads + opt_bytes) / mb, "params_m": len(params) and
            sum(p.numel() for p in params.values()) / 1e6, "trainable_m": trainable / 1e6}


def run_arm(name: str, root: Path, args: argparse.Namespace) -> dict:
    import torch

    from posttrain.config import build_config
    from posttrain.core.io import peak_rss_mb

    torch.set_num_threads(args.threads)
    command, extra = ARMS[name]
    common = {"model": str(root / "model"), "train_data": str(root / "prompts.jsonl"),
              "out_dir": str(root / "out" / command), "rewards": [
                  {"name": "benchmarks.memory:parity_reward", "weight": 1.0}],
              "prompts_per_step": args.prompts, "group_size": args.group,
              "max_new_tokens": args.new_tokens, "micro_batch_size": args.prompts * args.group,
              "max_steps": args.steps, "progress": False, "report_to": [], "threads": args.threads,
              "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], **extra}
    if command == "ppo":
        from posttrain.config.ppo import PPOConfig
        from posttrain.trainers.ppo import PPOTrainer

        cfg = build_config(PPOConfig, overrides={**common, "ppo_epochs": 1, "mini_batches": 1})
        cls = PPOTrainer
    else:
        from posttrain.config import GRPOConfig
        from posttrain.trainers.grpo import GRPOTrainer

        cfg, cls = build_config(GRPOConfig, overrides=common), GRPOTrainer
    base = current_rss_mb()
    trainer = cls(cfg)
    trainer.model.train()
    for step in range(1, args.steps + 1):
        trainer.step(step)
    peak = peak_rss_mb()
    return {"arm": name, "peak_rss_mb": peak, "base_rss_mb": base, "delta_mb": peak - base,
            **state_mb(trainer)}


def parity_reward(completion: str) -> float:
    """Half the completions score 1: non-zero advantages, no verifier cost."""
    return float(len(completion) % 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arm", default="", help=argparse.SUPPRESS)
    parser.add_argument("--root", default="", help=argparse.SUPPRESS)
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.arm:  # child process: one arm
        print(json.dumps(run_arm(args.arm, Path(args.root), args)))
        return
    root = Path(tempfile.mkdtemp(prefix="memory_bench_"))
    build_world(root, args.hidden, args.layers)
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("arm", "root", "json")]
    rows = []
    for name in ARMS:
        out = subprocess.run([sys.executable, __file__, *passthrough, f"--arm={name}",
                              f"--root={root}"], capture_output=True, text=True, check=False,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"done: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    params = rows[0]["trainable_m"] if rows else 0.0  # the first arm trains the full model
    print(f"model: hidden {args.hidden}, {args.layers} layers ({params:.1f}M parameters); "
          f"{args.prompts} prompts x {args.group} = {args.prompts * args.group} sequences, "
          f"{args.new_tokens} new tokens, {args.steps} steps, {args.threads} thread(s)")
    print("| arm | trainable (M) | weights MB | grads MB | AdamW MB | state MB | peak RSS MB "
          "| peak - base MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['trainable_m']:.2f} | {r['weights_mb']:.0f} | "
              f"{r['grads_mb']:.0f} | {r['optimizer_mb']:.0f} | {r['state_mb']:.0f} | "
              f"{r['peak_rss_mb']:.0f} | {r['delta_mb']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
