"""The checks behind ``scripts/gpu_smoke.sh``: build the smoke world, run a command and check
what it wrote, stop and resume a run, the recipe-shaped probe.

Every subcommand prints its findings as ``smoke: ...`` lines (the shell script echoes them under
the part's PASS/FAIL line) and exits non-zero when a check fails::

    python scripts/smoke_checks.py world OUT --size cpu|gpu
    python scripts/smoke_checks.py run --out DIR [--kl] [--gap] [--gap-max X] [--log-has TEXT]
        [--no-metrics] -- CMD...
    python scripts/smoke_checks.py vllm_server --out DIR --model M --port P --gpus G [run
        flags] -- CMD...   # a `vllm serve` on 127.0.0.1 (GPUs G) for the run, then stopped
    python scripts/smoke_checks.py resume --out DIR --steps 8 -- CMD...
    python scripts/smoke_checks.py probe --out DIR --shape 0.5b|tiny -- grpo --config ... k=v...

The checks read ``metrics.jsonl`` generically (one JSON object per line; a row with a
``loss/*`` key is a training step), so a trainer that adds metrics needs no change here.
``text_chars`` is the smoke runs' reward (``smoke_checks:text_chars`` with ``scripts/`` on
``PYTHONPATH``): it varies between samples of a random model, so the updates are not zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KL_KEYS = ("kl/token_mean", "kl/mean")
"""Per-token KL to the reference at a step (GRPO, PPO); the first step's must be ~0."""
GAP_KEYS = ("rollout/logprob_abs_diff", "rollout/k3")
"""The sampler/learner log-prob gap of a step's rollout."""
KL_FIRST_STEP_MAX = 1e-4
QWEN25_05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
              "intermediate_size": 4864, "max_position_embeddings": 32768}
"""Qwen2.5-0.5B's shape (vocabulary 151,936, tied embeddings, q/k/v biases)."""
WORLD_SIZES = {
    "cpu": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
            "intermediate_size": 64},
    # head_dim 64 (as Qwen2.5-0.5B's), so attention kernels of any engine accept it
    "gpu": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
            "intermediate_size": 256},
}


class CheckFailed(Exception):
    """One check did not hold; the message says which and why."""


def note(text: str) -> None:
    print(f"smoke: {text}", flush=True)


# ---- the reward of the smoke runs -----------------------------------------------------------
def text_chars(completion: str) -> float:
    """Decoded characters among the first 16, / 16. A random 151,936-row model samples mostly
    ids the char tokenizer does not have (they decode to nothing), so this varies by sample."""
    return min(len(completion), 16) / 16.0


# ---- metrics.jsonl ---------------------------------------------------------------------------
def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl (NaN / Infinity parsed as floats, as `json` writes them)."""
    path = Path(path)
    if not path.is_file():
        raise CheckFailed(f"{path}: missing")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise CheckFailed(f"{path}: empty")
    return rows


def train_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of training steps (those with a `loss/*` metric), in file order."""
    return [r for r in rows if any(k.startswith("loss/") for k in r)]


def check_finite_losses(rows: Sequence[dict[str, Any]]) -> str:
    """Every `loss/*` and `*grad_norm` value of every training row is a finite number."""
    steps = train_rows(rows)
    if not steps:
        raise CheckFailed("no training step in metrics.jsonl (no row with a loss/* metric)")
    bad = [(r.get("step"), k, v) for r in steps for k, v in r.items()
           if (k.startswith("loss/") or k.endswith("grad_norm"))
           and not (isinstance(v, (int, float)) and math.isfinite(v))]
    if bad:
        raise CheckFailed(f"non-finite losses (step, key, value): {bad[:5]}")
    last = steps[-1]
    losses = {k: round(v, 6) for k, v in last.items()
              if k.startswith("loss/") or k.endswith("grad_norm")}
    return f"{len(steps)} steps, losses finite; last step {last.get('step')}: {losses}"


def check_first_step_kl(rows: Sequence[dict[str, Any]], limit: float = KL_FIRST_STEP_MAX) -> str:
    """The first training step's KL to the reference (`KL_KEYS`) is below `limit`: the policy
    starts as the reference, so anything larger is a precision or bookkeeping error."""
    steps = train_rows(rows)
    if not steps:
        raise CheckFailed("no training step in metrics.jsonl")
    first = steps[0]
    found = {k: first[k] for k in KL_KEYS if k in first}
    if not found:
        raise CheckFailed(f"first step logs none of {list(KL_KEYS)} (is kl_coef > 0?)")
    over = {k: v for k, v in found.items() if not abs(v) < limit}
    if over:
        raise CheckFailed(f"first-step KL {over} is not < {limit:g}")
    return f"first-step KL {found} < {limit:g}"


def library_logs(key: str, root: Path = ROOT / "posttrain") -> bool:
    """Whether the library's source names the metric `key` (so a run must log it)."""
    return any(key in p.read_text(encoding="utf-8") for p in root.rglob("*.py"))


def check_gap(rows: Sequence[dict[str, Any]], required: bool) -> str:
    """The sampler/learner gap (`GAP_KEYS`) is logged at every training step, finite; reported
    as its first and largest value. `required` False (the library does not log it yet) turns a
    missing metric into a note instead of a failure."""
    steps = train_rows(rows)
    missing = [k for k in GAP_KEYS if not all(k in r for r in steps)]
    if missing:
        if required:
            raise CheckFailed(f"sampler/learner gap not logged at every step: {missing}")
        return f"sampler/learner gap SKIP: this tree does not log {missing} yet"
    parts = []
    for key in GAP_KEYS:
        values = [r[key] for r in steps]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise CheckFailed(f"{key} not finite: {values}")
        parts.append(f"{key} first {values[0]:.3g} max {max(values):.3g}")
    return "sampler/learner gap: " + "; ".join(parts)


def check_gap_bound(rows: Sequence[dict[str, Any]], bound: float) -> str:
    """A separate sampler (vLLM) is close to the learner but not identical: the mean over steps
    of `rollout/logprob_abs_diff` is in (0, bound). Exactly 0 means the learner's own forward
    sampled (the rollouts did not come from the engine)."""
    values = [r["rollout/logprob_abs_diff"] for r in train_rows(rows)]
    mean = sum(values) / max(1, len(values))
    if not values or mean == 0.0:
        raise CheckFailed(f"rollout/logprob_abs_diff {values}: exactly 0, so the samples did "
                          "not come from a separate engine")
    if not mean < bound:
        raise CheckFailed(f"sampler/learner gap: mean |logp diff| {mean:.4g} >= {bound}")
    return f"sampler/learner gap bound: mean |logp diff| {mean:.4g} < {bound}"


def check_summary(out: Path) -> dict[str, Any]:
    path = out / "summary.json"
    if not path.is_file():
        raise CheckFailed(f"{path}: missing")
    return json.loads(path.read_text())


# ---- final/ reloads --------------------------------------------------------------------------
def check_reload(path: str | Path, vocab_size: int | None = None) -> str:
    """`path` reloads with `from_pretrained` of the class its config.json names, and a forward
    pass on a few tokens of its tokenizer gives finite outputs."""
    import torch
    import transformers

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckFailed(f"{path}: no config.json (no final checkpoint written)")
    config = json.loads((path / "config.json").read_text())
    arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    model = getattr(transformers, arch).from_pretrained(path)
    if vocab_size is not None and model.config.vocab_size != vocab_size:
        raise CheckFailed(f"{path}: vocab_size {model.config.vocab_size} != {vocab_size}")
    ids = torch.tensor([[1, 20, 21, 22, 23]])
    if (path / "tokenizer_config.json").is_file():
        tok = transformers.AutoTokenizer.from_pretrained(path)
        ids = torch.tensor([tok("12+7=19;")["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids)
    value = out.logits if hasattr(out, "logits") else out.last_hidden_state
    if not torch.isfinite(value).all():
        raise CheckFailed(f"{path}: non-finite outputs after reload")
    return f"{path.name}/ reloads as {arch} ({sum(p.numel() for p in model.parameters())} params)"


# ---- subcommands -----------------------------------------------------------------------------
def _mean_text_chars(model: Any, tok: Any, prompts: list[str], seed: int = 0) -> float:
    """Mean `text_chars` of 4 plain samples (temperature 1, no top-k) per prompt."""
    import torch

    enc = tok([tok.bos_token + p + "\n" for p in prompts for _ in range(4)], return_tensors="pt",
              padding=True, padding_side="left")
    torch.manual_seed(seed)
    out = model.generate(**enc, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=16,
                         pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(text_chars(t) for t in texts) / len(texts)


def calibrate_vocab_rows(model: Any, tok: Any, prompts: list[str], target: float = 0.5) -> float:
    """Rescale the embedding rows of the tokenizer's ids (tied: the head's rows too) to std
    c / sqrt(hidden), c found by bisection so that about `target` of the first 16 sampled tokens
    decode. At transformers' init a sample almost never decodes (104 of 151,936 rows); too
    large a c and the model repeats the prompt's last character forever. Returns c."""
    import torch

    rows = model.model.embed_tokens.weight[: len(tok)]
    base = rows.detach().clone() / rows.std().item()
    scale = model.config.hidden_size ** -0.5
    lo, hi = 0.5, 4.0
    with torch.no_grad():
        for _ in range(6):
            c = (lo + hi) / 2
            rows.copy_(base * c * scale)
            lo, hi = (c, hi) if _mean_text_chars(model, tok, prompts) < target else (lo, c)
        c = (lo + hi) / 2
        rows.copy_(base * c * scale)
    return c


def build_world(out: Path, size: str) -> None:
    """The smoke world: a random Qwen2-shaped policy (151,936 rows, tied, q/k/v biases) saved
    to `out/init`, with its tokenizer rows calibrated (`calibrate_vocab_rows`) so its samples'
    `text_chars` rewards differ and the RL updates are not zero; arithmetic SFT rows, prompts,
    held-out prompts, preference pairs and step-labelled rows."""
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.arithmetic import (
        heldout_rows,
        prompt_rows,
        sft_rows,
        step_rows,
        write_jsonl,
    )
    from posttrain.tasks.preferences import offline_pairs
    from posttrain.tasks.tiny import build_tiny_qwen2
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    shape = WORLD_SIZES[size]
    model = build_tiny_qwen2(tok, **shape, seed=0)
    prompts = prompt_rows(64, 1)
    c = calibrate_vocab_rows(model, tok, [r["prompt"] for r in prompts[:8]])
    share = _mean_text_chars(model, tok, [r["prompt"] for r in prompts[8:16]], seed=1)
    save_checkpoint(model, tok, out / "init")
    write_jsonl(sft_rows(256, 0), out / "sft.jsonl")
    write_jsonl(prompts, out / "prompts.jsonl")
    write_jsonl(heldout_rows(8), out / "heldout.jsonl")
    write_jsonl(offline_pairs(64, 0, kind="sign"), out / "pairs.jsonl")
    write_jsonl(step_rows(64, 0), out / "steps.jsonl")
    params = sum(p.numel() for p in model.parameters())
    note(f"world in {out}: Qwen2 {shape}, vocab {model.config.vocab_size}, {params} params; "
         f"tokenizer rows at std {c:.2f}/sqrt(hidden): text_chars {share:.2f} on other prompts")


def check_push_gaps(rows: Sequence[dict[str, Any]]) -> str:
    """Every weight push was verified (`rollout/push_check_gap` at every training step)."""
    gaps = [r.get("rollout/push_check_gap") for r in train_rows(rows)]
    if not gaps or any(g is None for g in gaps):
        raise CheckFailed(f"rollout/push_check_gap missing at steps "
                          f"{[r.get('step') for r in train_rows(rows)]}: pushes not verified")
    return f"push check: gap max {max(gaps):.4g} over {len(gaps)} steps"


def run_checked(out: Path, cmd: list[str], *, kl: bool, gap: bool, metrics: bool,
                reload: bool, gap_max: float = 0.0, log_has: str = "",
                push_check: bool = False, clean_exit: bool = False) -> None:
    """Run `cmd` (exit 0 required), then check `out`: finite losses, first-step KL (`kl`), the
    sampler/learner gap (`gap`; `gap_max` > 0: bounded, `check_gap_bound`), `final/` reloads
    (`reload`); `log_has`: a line the run must print (e.g. vLLM's engine start);
    `push_check`: every push verified; `clean_exit`: no traceback in the output."""
    proc = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace")
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise CheckFailed(f"exit code {proc.returncode}: {' '.join(cmd[:6])} ...")
    if log_has and log_has not in proc.stdout:
        raise CheckFailed(f"the run never printed {log_has!r}: it did not use that engine")
    if clean_exit and "Traceback" in proc.stdout:
        raise CheckFailed("a traceback in the output of a run that exited 0 (teardown?)")
    summary = check_summary(out)
    if "stopped_at_step" in summary:
        raise CheckFailed(f"run stopped early at step {summary['stopped_at_step']}")
    if metrics:
        rows = read_metrics(out / "metrics.jsonl")
        note(check_finite_losses(rows))
        if kl:
            note(check_first_step_kl(rows))
        if gap:
            note(check_gap(rows, required=all(library_logs(k) for k in GAP_KEYS)))
        if gap_max > 0:
            note(check_gap_bound(rows, gap_max))
        if push_check:
            note(check_push_gaps(rows))
    if "methods" in summary:  # search: every method's accuracy (per n)
        accs = {m: v["accuracy"] if "accuracy" in v else {n: r["accuracy"] for n, r in v.items()}
                for m, v in summary["methods"].items()}
        note(f"search accuracy: {json.dumps(accs)[:300]}")
    elif not metrics:
        note(f"summary: { {k: summary.get(k) for k in ('eval_before', 'eval_after')} }")
    if reload:
        note(check_reload(out / "final"))


def vllm_server(out: Path, model: str, port: int, gpus: str, run: Any, cmd: list[str]) -> None:
    """Start `posttrain vllm-serve model` on 127.0.0.1:`port` (CUDA_VISIBLE_DEVICES=`gpus`:
    dev mode, processed log-probs, posttrain's worker extension, bf16), wait for /health, run
    the checked `cmd` against it, stop it; the server must have answered completions."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "vllm_server.log"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    serve = [sys.executable, "-m", "posttrain", "vllm-serve", model, "--port", str(port),
             "--log", str(log_path), "--gpu-memory-utilization", "0.5"]
    with log_path.open("w") as log:
        server = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(port, server, timeout=240)
        run(out, cmd)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    served = log_path.read_text(errors="replace").count("POST /v1/completions")
    if served == 0:
        raise CheckFailed(f"the server answered no /v1/completions ({log_path})")
    note(f"vllm_server answered {served} completion requests")


def _wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise CheckFailed(f"vllm serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise CheckFailed(f"vllm serve not healthy after {timeout:.0f} s")


def _wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout: float) -> None:
    start = time.time()
    while time.time() - start < timeout:
        ckpts = out / "checkpoints"
        if ckpts.is_dir() and any(p.name.startswith("step-") for p in ckpts.iterdir()):
            return
        if proc.poll() is not None:
            raise CheckFailed(f"run ended (exit {proc.returncode}) before its first checkpoint")
        time.sleep(0.02)
    raise CheckFailed(f"no checkpoint after {timeout:.0f} s")


def stop_and_resume(out: Path, cmd: list[str], steps: int, timeout: float = 300.0) -> None:
    """SIGTERM `cmd` (run with `max_steps=steps save_every=1`) once its first checkpoint is
    written; it must exit 0 with `stopped_at_step` S < steps in summary.json. Then relaunch with
    `resume_from=latest`: exit 0, every step 1..steps logged exactly once, `final/` reloads."""
    keys = [f"max_steps={steps}", "save_every=1"]
    proc = subprocess.Popen([*cmd, *keys])
    try:
        _wait_for_checkpoint(out, proc, timeout)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    if rc != 0:
        raise CheckFailed(f"stopped run exited {rc} (a graceful stop exits 0)")
    stopped = check_summary(out).get("stopped_at_step")
    if stopped is None or not 0 < stopped < steps:
        raise CheckFailed(f"summary.json stopped_at_step={stopped}: the SIGTERM did not stop the "
                          f"run inside its {steps} steps")
    note(f"SIGTERM after the first checkpoint: stopped at step {stopped}, exit 0")
    resumed = subprocess.run([*cmd, *keys, "resume_from=latest"], check=False)
    if resumed.returncode != 0:
        raise CheckFailed(f"resumed run exited {resumed.returncode}")
    logged = [r.get("step") for r in train_rows(read_metrics(out / "metrics.jsonl"))]
    if logged != list(range(1, steps + 1)):
        raise CheckFailed(f"steps logged after resume: {logged} (want 1..{steps} once each)")
    note(f"resumed from step {stopped}: steps 1..{steps} logged once each")
    note(check_reload(out / "final"))


def probe(out: Path, shape: str, argv: list[str]) -> None:
    """The recipe-shaped probe: a random Qwen2 of `shape` (`0.5b`: Qwen2.5-0.5B's; `tiny`) is
    written to `out/model`, then `posttrain <argv> model=... out_dir=...` runs in this process;
    prints the generation and training time of its step(s) and the peak CUDA memory."""
    import torch

    from posttrain.cli import main as cli_main
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.tiny import build_tiny_qwen2
    from posttrain.tasks.tokenizer import build_char_tokenizer

    cuda = torch.cuda.is_available() and not any(a in ("device=cpu",) for a in argv)
    tok = build_char_tokenizer()
    dims = QWEN25_05B if shape == "0.5b" else {**WORLD_SIZES["cpu"],
                                               "max_position_embeddings": 1024}
    start = time.time()
    with torch.device("cuda" if cuda else "cpu"):
        model = build_tiny_qwen2(tok, **dims, seed=0)
    params = sum(p.numel() for p in model.parameters())
    save_checkpoint(model, tok, out / "model")
    del model
    note(f"probe model: Qwen2 {dims}, vocab 151936, {params / 1e6:.1f}M params, built and "
         f"saved in {time.time() - start:.1f} s")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rc = cli_main([*argv, f"model={out / 'model'}", f"out_dir={out / 'run'}"])
    if rc != 0:
        raise CheckFailed(f"probe run exited {rc}")
    step = train_rows(read_metrics(out / "run" / "metrics.jsonl"))[-1]
    perf = {k: round(v, 3) for k, v in step.items()
            if k in ("perf/gen_seconds", "perf/train_seconds", "perf/step_seconds",
                     "perf/gen_tokens_per_sec", "response/length_mean")
            or k.startswith("gpu/")}
    note(f"probe step {step.get('step')}: {perf}")
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
        note(f"probe torch.cuda.max_memory_allocated: {peak:.2f} GiB "
             f"(reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB)")
    else:
        note(f"probe on cpu: no CUDA memory; perf/peak_rss_mb {step.get('perf/peak_rss_mb')}")


# ---- command line ----------------------------------------------------------------------------
def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str] | None = None) -> int:
    own, cmd = _split(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="smoke_checks.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    world = sub.add_parser("world")
    world.add_argument("out", type=Path)
    world.add_argument("--size", choices=sorted(WORLD_SIZES), default="cpu")
    run = sub.add_parser("run")
    server = sub.add_parser("vllm_server")
    server.add_argument("--model", required=True)
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--gpus", default="1", help="CUDA_VISIBLE_DEVICES of the server")
    for p in (run, server):
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--kl", action="store_true", help="first-step KL < 1e-4")
        p.add_argument("--gap", action="store_true", help="sampler/learner gap logged")
        p.add_argument("--gap-max", type=float, default=0.0, help="mean |logp diff| bound")
        p.add_argument("--log-has", default="", help="a line the run must print")
        p.add_argument("--push-check", action="store_true", help="every weight push verified")
        p.add_argument("--clean-exit", action="store_true", help="no traceback in the output")
        p.add_argument("--no-metrics", action="store_true", help="search / eval: no metrics")
        p.add_argument("--no-reload", action="store_true", help="no final/ to reload")
    resume = sub.add_parser("resume")
    resume.add_argument("--out", type=Path, required=True)
    resume.add_argument("--steps", type=int, default=8)
    prb = sub.add_parser("probe")
    prb.add_argument("--out", type=Path, required=True)
    prb.add_argument("--shape", choices=("0.5b", "tiny"), default="0.5b")
    args = parser.parse_args(own)
    try:
        if args.what == "world":
            build_world(args.out, args.size)
        elif not cmd:
            parser.error(f"{args.what}: give the command after --")
        elif args.what in ("run", "vllm_server"):
            def checked(out: Path, command: list[str]) -> None:
                run_checked(out, command, kl=args.kl, gap=args.gap, gap_max=args.gap_max,
                            log_has=args.log_has, metrics=not args.no_metrics,
                            reload=not args.no_reload, push_check=args.push_check,
                            clean_exit=args.clean_exit)
            if args.what == "run":
                checked(args.out, cmd)
            else:
                vllm_server(args.out, args.model, args.port, args.gpus, checked, cmd)
        elif args.what == "resume":
            stop_and_resume(args.out, cmd, args.steps)
        else:
            probe(args.out, args.shape, cmd)
    except CheckFailed as err:
        note(f"FAIL {err}")
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    sys.exit(main())
