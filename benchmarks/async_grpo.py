"""Asynchronous GRPO (`async_rollouts`) against synchronous GRPO on the same work.

    python benchmarks/async_grpo.py --out /tmp/async_grpo                  # demo + long
    python benchmarks/async_grpo.py --out /tmp/async_grpo --settings tools --tools runs/tools
    .venv-vllm/bin/python benchmarks/async_grpo.py --engine vllm_server --settings demo

Per setting and seed, one run of each mode in this order, same seeds and samples, each a
`posttrain grpo` in a fresh process as a user runs it (its imports, and async's sampler start
beside them, before its first step): (a) `sync2`:
synchronous on 2 threads; (b) `sync1`: synchronous on 1 thread, whose sampling + scoring seconds
are the sampler alone (S) and the rest of its steps the learner alone (L); (c) `async1`,
`async2`: async at max_staleness 1 and 2, learner and sampler process on 1 thread each.
Printed per setting: step seconds (the sum of `perf/step_seconds`: evaluations excluded),
samples/s, the overlap bound = (a) / max(S, L), the efficiency = max(S, L) / (c) (1.0: perfect
overlap) and the speed against (a), over the whole run and from step 2 (without the sampler
process's start, about 3 s here), and held-out greedy accuracy after training (mean +- std over
seeds). `--table` prints the table of the runs already in OUT; `--modes ... async1_pass` adds async1
with the truncated weights' own forward pass (the fast path of `GRPOTrainer` off).
Settings: `demo` (the demo's GRPO stage from its SFT start, 60 steps), `long` (the demo's
untrained start, which rarely stops: 160 new tokens, 8 steps), `tools` (the tool world of
`python -m posttrain.tasks.tool_world --out DIR`, its recipe, 12 steps). Nothing else should run.
`--engine vllm_server` samples every mode on one `posttrain vllm-serve` of the setting's model
(vLLM's CPU build, float32; its log in OUT/SETTING_vllm_server/server.log), a third process
on the same cores; `--steps N` shortens a setting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from posttrain.config import GRPOConfig, SFTConfig, build_config
from posttrain.demo import _settings, build_world

MODES = {"sync2": {"threads": 2}, "sync1": {"threads": 1},
         "async1": {"threads": 1, "async_rollouts": True, "max_staleness": 1},
         "async2": {"threads": 1, "async_rollouts": True, "max_staleness": 2},
         # async1 with the truncated weights' own forward pass (GRPOTrainer's fast path off)
         "async1_pass": {"threads": 1, "async_rollouts": True, "max_staleness": 1,
                         "defer": False}}
DEFAULT_MODES = ["sync2", "sync1", "async1", "async2"]


def demo_start(out: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The demo's world and SFT start (seed 0), built once under `out`."""
    from posttrain.trainers.sft import SFTTrainer

    s = _settings(False)
    paths = build_world(out, 0, s)
    if not (out / "sft" / "final").is_dir():
        sft = {k: v for k, v in s["sft"].items() if k not in ("rows", "flaw_rate")}
        SFTTrainer(build_config(SFTConfig, overrides={
            "model": str(out / "init"), "out_dir": str(out / "sft"), "train_data": paths["sft"],
            "seed": 0, "max_seq_len": 128, "threads": 2, "overwrite": True,
            "progress": False, "report_to": [], **sft})).train()
    return s, paths


def setting_keys(name: str, out: Path, tools: str) -> dict[str, Any]:
    """GRPO config keys of a setting (model, data, budget)."""
    if name == "tools":
        recipe = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "grpo_tools.yaml")
                                .read_text())
        recipe = {k: v.replace("runs/tools", tools) if isinstance(v, str) else v
                  for k, v in recipe.items() if k not in ("trainer", "out_dir")}
        return {**recipe, "max_steps": 12, "eval_every": 0, "eval_size": 100}
    s, paths = demo_start(out / "demo_world")
    keys = {"train_data": paths["prompts"], "eval_data": paths["heldout"],
            **{**s["grpo"], "eval_every": 0}}
    if name == "demo":
        return {**keys, "model": str(out / "demo_world" / "sft" / "final"), "eval_size": 500}
    return {**keys, "model": str(out / "demo_world" / "init"), "max_steps": 8,
            "max_new_tokens": 160, "eval_max_new_tokens": 160, "eval_size": 20}


@contextlib.contextmanager
def server(model: str, log: Path) -> Iterator[dict[str, Any]]:
    """A `posttrain vllm-serve` of `model` on a free port while the block runs: the GRPO keys
    that sample on it."""
    from posttrain.rollout.vllm_serve import serve_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env, argv = serve_command(model, port=port, log=str(log))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    sys.exit(f"[async_grpo] the server exited; its log: {log}")
                time.sleep(1)
        yield {"rollout_engine": "vllm_server", "vllm_server_port": port}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(keys: dict[str, Any], mode: str, seed: int, out: Path) -> dict[str, float]:
    """One run as a user starts it: `posttrain grpo --config` in a fresh process (its imports
    and the sampler process's start included; `async1_pass`: in this process)."""
    keys = {**keys, **MODES[mode], "seed": seed, "out_dir": str(out), "overwrite": True,
            "progress": False, "report_to": [], "save_every": 0}
    t0 = time.time()
    if not keys.pop("defer", True):
        from posttrain.trainers.grpo import GRPOTrainer

        GRPOTrainer.defer_truncated_weights = False
        GRPOTrainer(build_config(GRPOConfig, overrides=keys)).train()
        GRPOTrainer.defer_truncated_weights = True
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out.parent / f"{mode}_{seed}.yaml").write_text(yaml.safe_dump(keys))
        subprocess.run([sys.executable, "-m", "posttrain", "grpo", "--config",
                        str(out.parent / f"{mode}_{seed}.yaml")], check=True,
                       stdout=subprocess.DEVNULL)
    return {**measure(out), "wall": time.time() - t0}


def measure(out: Path) -> dict[str, float]:
    """Seconds of a finished run's steps (all; `_steady`: from step 2, the sampler process
    started), the sampler's share, samples and held-out accuracy after training."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_seconds" in r]
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    res: dict[str, float] = {"samples": float(len(rows) * cfg["prompts_per_step"]
                                              * cfg["group_size"]),
                             "accuracy": json.loads((out / "summary.json").read_text())[
                                 "eval_after"]}
    for tag, part in (("", rows), ("_steady", rows[1:])):
        sampler = sum(r["perf/gen_seconds"] + r["perf/score_seconds"] for r in part)
        total = sum(r["perf/step_seconds"] for r in part)
        res.update({f"seconds{tag}": total, f"sampler{tag}": sampler,
                    f"learner{tag}": total - sampler})
    return res


def report(name: str, res: dict[int, dict[str, dict[str, float]]]) -> list[str]:
    """Markdown rows of one setting: per mode the step seconds, samples/s, the overlap bound,
    efficiency and the speed against sync2 (whole run; from step 2) and held-out accuracy."""
    def mean(mode: str, key: str) -> float:
        return statistics.mean(res[s][mode][key] for s in res)

    def alone(seed: int, tag: str) -> float:  # max(sampler alone, learner alone), 1 thread
        return max(res[seed]["sync1"][f"sampler{tag}"], res[seed]["sync1"][f"learner{tag}"])

    bound = statistics.mean(res[s]["sync2"]["seconds"] / alone(s, "") for s in res)
    lines = []
    for mode in next(iter(res.values())):
        acc = [res[s][mode]["accuracy"] * 100 for s in res]
        cells = []
        for tag in ("", "_steady"):
            eff = [alone(s, tag) / res[s][mode][f"seconds{tag}"] for s in res]
            fast = [res[s]["sync2"][f"seconds{tag}"] / res[s][mode][f"seconds{tag}"]
                    for s in res]
            cells += [f"{statistics.mean(eff):.2f}" if mode.startswith("async") else "",
                      f"{statistics.mean(fast):.2f}x"]
        lines.append(f"| {name} | {mode} | {mean(mode, 'seconds'):.1f} | "
                     f"{mean(mode, 'samples') / mean(mode, 'seconds'):.0f} | {bound:.2f} | "
                     + " | ".join(cells) +
                     f" | {statistics.mean(acc):.1f} +- {statistics.pstdev(acc):.1f} |")
    lines.append(f"| {name} | S / L alone, 1 thread | {mean('sync1', 'sampler'):.1f} / "
                 f"{mean('sync1', 'learner'):.1f} | | | | | | | |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", nargs="+", default=["demo", "long"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tools", default="runs/tools", help="the tool world's folder")
    ap.add_argument("--out", default="/tmp/async_grpo")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES),
                    help="sync1 and sync2 are needed for the bound and the ratios")
    ap.add_argument("--table", action="store_true", help="only the table of the runs in OUT")
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm_server"])
    ap.add_argument("--steps", type=int, default=0, help="max_steps of every setting (0: its own)")
    args = ap.parse_args()
    if not {"sync1", "sync2"} <= set(args.modes):
        ap.error("--modes needs sync1 and sync2: the table's overlap bound and speeds are "
                 "measured against them")
    out, table = Path(args.out), []
    dirs = {n: n if args.engine == "hf" else f"{n}_{args.engine}" for n in args.settings}
    missing = [out / dirs[n] / f"{m}_{s}" for n in args.settings for s in args.seeds
               for m in args.modes if not (out / dirs[n] / f"{m}_{s}" / "summary.json").is_file()]
    if args.table and missing:
        sys.exit(f"[async_grpo] --table: {len(missing)} run(s) not finished in {out} (first: "
                 f"{missing[0]}); run `python benchmarks/async_grpo.py --out {out}` first")
    for name in args.settings:
        res: dict[int, dict[str, dict[str, float]]] = {}
        keys = {} if args.table else setting_keys(name, out, args.tools)
        keys |= {"max_steps": args.steps} if args.steps else {}
        where = out / dirs[name]
        with server(keys["model"], where / "server.log") if args.engine != "hf" and \
                not args.table else contextlib.nullcontext({}) as engine:
            for seed in args.seeds:
                res[seed] = {m: measure(where / f"{m}_{seed}") if args.table
                             else run({**keys, **engine}, m, seed, where / f"{m}_{seed}")
                             for m in args.modes}
                print(json.dumps({dirs[name]: {seed: res[seed]}}), flush=True)
        table += report(dirs[name], res)
    print("| setting | mode | step seconds | samples/s | bound | efficiency | vs sync2 | "
          "efficiency from step 2 | vs sync2 from step 2 | accuracy % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))

if __name__ == "__main__":
    sys.exit(main())
