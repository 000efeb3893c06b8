"""posttrain vs TRL, side by side: GRPO and DPO seconds per step and peak memory on identical work.

    pip install -e '.[bench]'            # or TRL in a separate venv, passed as --trl-python
    python benchmarks/vs_trl.py --trl-python /work/venv_trl/bin/python --reps 2

Work (issue 14): GRPO with G=8 samples x 8 prompts per step, <= 32 new tokens (`--new-tokens`),
16-token prompts,
beta 0.04 with the k3 estimator in the loss, the same length-parity reward, one optimizer step
per rollout, lr 1e-6, temperature 1, one micro-batch of 64; DPO (sigmoid, beta 0.1) on 8 pairs of
~66 tokens per sequence with the reference forward every step. Models are built once, locally,
randomly initialised: Llama 0.55M, 19M and 205M on the 104-token character vocabulary, and a
Qwen2-shaped model (hidden 896, 2 layers, 14 heads, 2 KV heads, vocabulary 151,936) for the
real-vocabulary rows (8 samples of one prompt, 256 or 1,024 new tokens; EOS is improbable).

Every (framework, setting) runs in its own process (TRL in `--trl-python`, ours in this Python),
`--warmup` untimed steps then `--steps` timed ones; repetitions are interleaved (A B C A B C) so
that load from other jobs hits all settings alike. The table gives the median over repetitions
of each run's median s/step, the ratio TRL / ours, and peak RSS (max over repetitions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLAMAS = {
    "0.55M": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512},
    "19M": {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "intermediate_size": 1376},
    # 10.8x the 19M model: 16 layers of 12.8M parameters, where the matrix multiplies of the
    # learner dominate a step and Python does not
    "205M": {"hidden_size": 1024, "num_layers": 16, "num_heads": 16, "intermediate_size": 2816},
}
# this checkout's posttrain, not whichever one the interpreter has installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
QWEN_VOCAB = 151_936
ALPHABET = "0123456789+-*="


def parity_reward(completion: str) -> float:
    """Half of a group scores 1 (non-zero advantages) at no verifier cost."""
    return float(len(completion) % 2)


def trl_parity_reward(completions: list[str], **_: object) -> list[float]:
    return [parity_reward(c) for c in completions]


# ---- building the models and data (once, in this Python) -------------------------------------
def _big_vocab_tokenizer():
    """The character tokenizer's tokens plus fillers up to 151,936 ids (no merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from posttrain.tasks.tokenizer import CHARS

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    base = specials + list(CHARS)
    vocab = {t: i for i, t in enumerate(base + [f"<f{i}>" for i in range(QWEN_VOCAB - len(base))])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def build(root: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    for name, shape in LLAMAS.items():
        if not (root / name / "config.json").exists():
            save_checkpoint(build_tiny_llama(tok, **shape, seed=0), tok, root / name)
    if not (root / "qwen152k" / "config.json").exists():
        btok = _big_vocab_tokenizer()
        btok.chat_template = tok.chat_template
        cfg = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=896, intermediate_size=4864,
                          num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                          max_position_embeddings=2048, tie_word_embeddings=True,
                          pad_token_id=btok.pad_token_id, bos_token_id=btok.bos_token_id,
                          eos_token_id=btok.eos_token_id)
        torch.manual_seed(0)
        save_checkpoint(Qwen2ForCausalLM(cfg), btok, root / "qwen152k")
    rng = random.Random(0)
    with (root / "prompts.jsonl").open("w") as fh:
        for _ in range(512):
            fh.write(json.dumps({"prompt": "".join(rng.choices(ALPHABET, k=15)),
                                 "answer": "0"}) + "\n")
    with (root / "pairs.jsonl").open("w") as fh:
        for _ in range(256):  # ~30-token prompt, ~35-token completions: ~66 tokens a sequence
            p, c, r = ("".join(rng.choices(ALPHABET, k=k)) for k in (30, 34, 34))
            fh.write(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n")


# ---- one run (in its own process) --------------------------------------------------------------
def _work(spec: dict) -> dict:
    """The shared work of a spec: model dir, group size, prompts per step, new tokens."""
    if spec["model"] == "qwen152k":
        return {"G": 8, "prompts": 1, "new": spec["new_tokens"], "micro": spec.get("micro", 8)}
    return {"G": 8, "prompts": 8, "new": spec.get("new_tokens", 32), "micro": 64}


def run_ours(spec: dict, root: Path, out: Path) -> tuple[list[float], list[float]]:
    from posttrain.config import DPOConfig, GRPOConfig, build_config
    from posttrain.trainers.dpo import DPOTrainer
    from posttrain.trainers.grpo import GRPOTrainer

    steps = spec["warmup"] + spec["steps"]
    common = {"model": str(root / spec["model"]), "out_dir": str(out), "max_steps": steps,
              "threads": spec["threads"], "progress": False,
              "autocast_bf16": spec["setting"].startswith("bf16"),
              "bf16_compute": spec["setting"].startswith("bf16c"),
              "torch_compile": "compile" in spec["setting"],
              "gradient_checkpointing": "_ckpt" in spec["setting"],
              "share_prompt_prefix": "noshare" not in spec["setting"]}
    if spec["algo"] == "dpo":
        cfg = build_config(DPOConfig, overrides={
            **common, "train_data": str(root / "pairs.jsonl"), "batch_size": 8,
            "micro_batch_size": 16, "precompute_ref": False, "lr": 1e-6, "beta": 0.1})
        DPOTrainer(cfg).train()
    else:
        w = _work(spec)
        cfg = build_config(GRPOConfig, overrides={
            **common, "train_data": str(root / "prompts.jsonl"),
            "rewards": [{"name": f"{__name__}:parity_reward"}], "group_size": w["G"],
            "prompts_per_step": w["prompts"], "max_new_tokens": w["new"],
            "kl_coef": spec["beta"], "kl_estimator": "k3", "lr": 1e-6,
            "micro_batch_size": w["micro"]})
        GRPOTrainer(cfg).train()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_seconds" in r]
    return [r["perf/step_seconds"] for r in rows], [r["perf/pad_fraction"] for r in rows]


def _trl_common(spec: dict, out: Path) -> dict:
    bf16 = spec["setting"].startswith("bf16")
    return {"output_dir": str(out), "max_steps": spec["warmup"] + spec["steps"],
            "learning_rate": 1e-6, "use_cpu": True, "bf16": bf16,
            "gradient_checkpointing": "nockpt" not in spec["setting"],
            "torch_compile": "compile" in spec["setting"],
            "report_to": "none", "save_strategy": "no", "logging_steps": 1,
            "dataloader_num_workers": 0, "seed": 0}


def run_trl(spec: dict, root: Path, out: Path) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.time()

        def on_step_end(self, *a, **k):
            times.append(time.time() - self.t0)

    model_dir = str(root / spec["model"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if spec["algo"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        rows = [json.loads(x) for x in (root / "pairs.jsonl").read_text().splitlines()]
        ds = Dataset.from_list(rows)
        cfg = DPOConfig(**_trl_common(spec, out), per_device_train_batch_size=8, beta=0.1,
                        precompute_ref_log_probs=False)
        trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                             callbacks=[Timer()])
    else:
        from trl import GRPOConfig, GRPOTrainer

        w = _work(spec)
        rows = [json.loads(x) for x in (root / "prompts.jsonl").read_text().splitlines()]
        ds = Dataset.from_list([{"prompt": r["prompt"] + "\n"} for r in rows])
        n = w["G"] * w["prompts"]  # one optimizer step per rollout, micro-batches of w["micro"]
        cfg = GRPOConfig(**_trl_common(spec, out), per_device_train_batch_size=w["micro"],
                         gradient_accumulation_steps=n // w["micro"], generation_batch_size=n,
                         num_generations=w["G"], max_completion_length=w["new"],
                         beta=spec["beta"], loss_type="grpo", temperature=1.0,
                         log_completions=False)
        trainer = GRPOTrainer(model=model, reward_funcs=[trl_parity_reward], args=cfg,
                              train_dataset=ds, processing_class=tok, callbacks=[Timer()])
    trainer.train()
    return times, []  # TRL logs no pad fraction


def run_one(spec: dict) -> dict:
    import tempfile

    import torch

    torch.set_num_threads(spec["threads"])
    root = Path(spec["root"])
    out = Path(tempfile.mkdtemp(prefix="vs_trl_"))
    times, pads = (run_trl if spec["framework"] == "trl" else run_ours)(spec, root, out)
    timed = times[spec["warmup"]:]
    return {"s_per_step": statistics.median(timed), "times": [round(t, 3) for t in times],
            "pad_fraction": statistics.mean(pads) if pads else None,
            "peak_rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: reset by exec, unlike ru_maxrss, which a child
    inherits from the driver that forked it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- the driver ------------------------------------------------------------------------------
def _rows(args: argparse.Namespace) -> list[tuple[str, dict, list[tuple[str, str]]]]:
    """(label, shared spec, [(framework, setting)]) for every benchmark row."""
    trl = [("trl", s) for s in args.trl_settings]
    ours = [("ours", s) for s in args.our_settings]
    rows = []
    for name in args.models:
        if name == "qwen152k":
            for n in args.real_vocab_tokens:
                micro = 8 if n <= 256 else 4  # TRL's [micro, n, V] fp32 logits: 2.5 GB at 1,024
                rows.append((f"GRPO 152k vocab, {n} tokens", {
                    "algo": "grpo", "model": name, "beta": 0.04, "new_tokens": n,
                    "micro": micro, "warmup": 0, "steps": 1},
                    [("trl", s) for s in args.trl_settings if "compile" not in s]
                    + [("ours", s) for s in args.our_settings if s.startswith("fp32")]))
        elif args.grpo:
            for n in args.new_tokens:
                label = f"GRPO {name}" + ("" if n == 32 else f", {n} tokens")
                rows.append((label, {"algo": "grpo", "model": name, "beta": 0.04,
                                     "new_tokens": n}, trl + ours))
    if args.dpo:
        rows += [(f"DPO {name}", {"algo": "dpo", "model": name}, trl + ours)
                 for name in args.models if name in LLAMAS]
    return rows


def _launch(spec: dict, args: argparse.Namespace) -> dict:
    python = args.trl_python if spec["framework"] == "trl" else sys.executable
    proc = subprocess.run([python, __file__, "--one", json.dumps(spec)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="/tmp/vs_trl_models")
    ap.add_argument("--trl-python", default=sys.executable)
    ap.add_argument("--models", nargs="*", default=["0.55M", "19M", "qwen152k"],
                    choices=[*LLAMAS, "qwen152k"])
    ap.add_argument("--real-vocab-tokens", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--new-tokens", nargs="+", type=int, default=[32],
                    help="the Llama GRPO rows' most new tokens (one row each)")
    ap.add_argument("--trl-settings", nargs="*",  # none: only our runs
                    default=["bf16", "fp32", "fp32_nockpt", "bf16_nockpt"])
    ap.add_argument("--our-settings", nargs="+", default=["fp32", "bf16"],
                    help="fp32, bf16 (autocast), bf16c (bf16_compute), bf16c_compile "
                    "(+ torch_compile), fp32_ckpt, bf16_ckpt "
                    "(_ckpt: gradient_checkpointing), fp32_noshare, bf16_noshare, "
                    "fp32_ckpt_noshare (share_prompt_prefix off); "
                    "the 152k rows run the fp32 ones")
    ap.add_argument("--no-dpo", dest="dpo", action="store_false")
    ap.add_argument("--no-grpo", dest="grpo", action="store_false",
                    help="only the DPO rows (and the 152k rows, if asked for)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build:
        build(Path(args.build))
        return
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "--build", str(root)], check=True,
                   capture_output=True)
    print(f"# vs_trl: threads={args.threads} reps={args.reps} steps={args.steps} "
          f"warmup={args.warmup}; load before {os.getloadavg()[0]:.2f}", flush=True)
    for label, shared, runs in _rows(args):
        results: dict[tuple[str, str], list[dict]] = {r: [] for r in runs}
        for rep in range(args.reps):
            for fw, setting in runs:  # interleaved: every setting once per repetition
                spec = {"warmup": args.warmup, "steps": args.steps, **shared, "framework": fw,
                        "setting": setting, "threads": args.threads, "root": str(root)}
                r = _launch(spec, args)
                results[(fw, setting)].append(r)
                print(f"#   {label} rep {rep} {fw} {setting}: {json.dumps(r)} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
        _print_row(label, results)
    print(f"# load after {os.getloadavg()[0]:.2f}")


def _print_row(label: str, results: dict[tuple[str, str], list[dict]]) -> None:
    med = {k: statistics.median(r["s_per_step"] for r in v) for k, v in results.items()
           if v and all("s_per_step" in r for r in v)}
    rss = {k: max(r["peak_rss_mb"] for r in v) for k, v in results.items() if k in med}
    trl = {k: t for k, t in med.items() if k[0] == "trl"}
    print(f"| {label} | setting | s/step (median) | pad fraction | peak RSS MB | "
          "TRL-default / this | TRL-fastest / this |")
    default = trl.get(("trl", "bf16"))  # TRL's defaults (bf16 + checkpointing), if run
    fastest = min(trl.values()) if trl else None
    for (fw, setting), v in results.items():
        if (fw, setting) not in med:
            print(f"| {fw} | {setting} | failed: {v[-1].get('error', '?')[:200]} | | | | |")
            continue
        s, pad = med[(fw, setting)], v[-1].get("pad_fraction")
        pad_text = "n/a" if pad is None else f"{pad:.1%}"  # TRL logs none
        print(f"| {fw} | {setting} | {s:.3f} | {pad_text} | {rss[(fw, setting)]:.0f} | "
              f"{_ratio(default, s)} | {_ratio(fastest, s)} |", flush=True)


def _ratio(ref: float | None, s: float) -> str:
    return f"{ref / s:.2f}x" if ref else ""


if __name__ == "__main__":
    main()
