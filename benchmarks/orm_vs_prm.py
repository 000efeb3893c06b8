"""ORM vs PRM on the arithmetic task: "Let's Verify Step by Step" (Lightman et al. 2023), small.

    python benchmarks/orm_vs_prm.py --quick --out runs/orm_vs_prm_quick
    python benchmarks/orm_vs_prm.py --out runs/orm_vs_prm            # the full run
    python benchmarks/orm_vs_prm.py --world runs/demo --out DIR      # reuse a demo's SFT model
    python benchmarks/orm_vs_prm.py --world runs/demo --verifier-init runs/demo/grpo/final \
        --out DIR                                       # verifiers start from the GRPO policy

1. World: the demo's tokenizer, tiny Llama and flawed SFT traces, then the SFT warm start
   (``posttrain.demo``), unless ``--world DIR`` points at a directory holding ``sft/final``.
2. Verifier data: the SFT policy samples ``train_samples`` solutions for each of
   ``train_problems`` training problems (temperature 1). The SAME samples become ORM rows
   (``{prompt, completion, label}``: is the final answer right) and PRM rows (``{prompt, steps,
   labels}``: exact step labels, every step after the first error negative;
   ``posttrain.tasks.step_labels``).
3. An ORM (binary correctness) and a PRM (2-class steps) are trained from the same checkpoint
   (``--verifier-init DIR``, default the SFT policy; e.g. the demo's GRPO policy, the best
   checkpoint of the same family) with the same steps, batch and learning rate: same decoder,
   same size.
4. Held-out: ``n_max`` samples per held-out problem, scored once by each verifier; best-of-N with
   the ORM and the PRM (product of step probabilities), majority vote and PRM-weighted vote at
   N = 1, 4, 16, 64 (disjoint groups of the n_max samples: n_max/N trials per problem); PRM beam
   search with beam_width * expansions = n_max candidates per round, so its generated tokens are
   comparable to best-of-n_max (both are reported).
5. ``DIR/results.json`` (the shape the issue asks for), ``DIR/details.json`` (tokens, pass@N,
   timings, verifier metrics, settings) and ``DIR/accuracy_vs_n.png``.

``orm_pair_accuracy``: over held-out problems, the fraction of (correct, wrong) pairs of the
policy's own samples that the ORM orders right (ties count 1/2). ``prm_step_f1``: F1 of the
"bad step" class (P(good) < 0.5) against exact labels on the held-out samples' steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

SETTINGS: dict[str, dict[str, Any]] = {
    "full": {"sft_steps": 1500, "train_problems": 16000, "train_samples": 8, "heldout": 200,
             "n_max": 64, "rm_steps": 2000, "rm_batch": 64, "rm_lr": 7e-4, "beam_width": 16,
             "expansions": 4, "max_new_tokens": 48},
    "quick": {"sft_steps": 1500, "train_problems": 8000, "train_samples": 8, "heldout": 64,
              "n_max": 64, "rm_steps": 800, "rm_batch": 64, "rm_lr": 7e-4, "beam_width": 16,
              "expansions": 4, "max_new_tokens": 48},
}
N_VALUES = (1, 4, 16, 64)
PAPER = {"orm": 0.724, "prm": 0.782, "n": 1860}  # Lightman et al. 2023, best-of-1860, MATH subset


def build_world(out: Path, s: dict[str, Any], seed: int, threads: int) -> Path:
    """Stage 1: the demo's world and SFT model under ``out``; returns the SFT checkpoint."""
    from posttrain.config import SFTConfig, build_config
    from posttrain.core.io import finished
    from posttrain.demo import _settings
    from posttrain.demo import build_world as demo_world
    from posttrain.trainers.sft import SFTTrainer

    demo = _settings(False)
    demo["sft"].update(rows=64 * s["sft_steps"], max_steps=s["sft_steps"])
    demo["heldout"] = 200
    paths = demo_world(out, seed, demo)
    sft = {k: v for k, v in demo["sft"].items() if k not in ("rows", "flaw_rate")}
    cfg = build_config(SFTConfig, overrides={
        "model": str(out / "init"), "out_dir": str(out / "sft"), "train_data": paths["sft"],
        "eval_data": paths["heldout"], "eval_size": 200, "seed": seed, "lr_schedule": "cosine",
        "max_seq_len": 128, "threads": threads, "progress": False, **sft})
    finished(SFTTrainer(cfg).train(), "the SFT stage")  # a stopped run has no final/
    return out / "sft" / "final"


def verifier_rows(policy: Any, tok: Any, s: dict[str, Any], seed: int, data: Path
                  ) -> dict[str, Any]:
    """Stage 2: one set of policy samples -> ORM rows and PRM rows (same problems/samples)."""
    from posttrain.tasks.arithmetic import write_jsonl
    from posttrain.tasks.step_labels import exact_rows

    rows = exact_rows(policy, tok, s["train_problems"], seed, split="train",
                      samples=s["train_samples"], max_new_tokens=s["max_new_tokens"])
    orm = [{"prompt": r["prompt"], "completion": r["completion"], "label": int(r["correct"])}
           for r in rows]
    prm = [{"prompt": r["prompt"], "steps": r["steps"], "labels": r["labels"]} for r in rows]
    return {"orm": str(write_jsonl(orm, data / "orm_train.jsonl")),
            "prm": str(write_jsonl(prm, data / "prm_train.jsonl")),
            "samples": len(rows), "correct_rate": sum(r["correct"] for r in rows) / len(rows),
            "dropped_truncated": s["train_problems"] * s["train_samples"] - len(rows)}


def train_one(kind: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Train one verifier, ``kind`` "orm" (binary correctness) or "prm", in this process;
    returns its last logged metrics and wall seconds (a process-pool task: picklable in/out)."""
    from posttrain.config import PRMConfig, RMConfig, build_config
    from posttrain.core.io import finished
    from posttrain.trainers.prm import PRMTrainer
    from posttrain.trainers.reward_model import RewardModelTrainer

    t0 = time.time()
    if kind == "orm":
        out = RewardModelTrainer(build_config(RMConfig, overrides=overrides)).train()
    else:
        out = PRMTrainer(build_config(PRMConfig, overrides=overrides)).train()
    finished(out, f"the {kind} stage")  # a stopped run has no final/ to evaluate
    return {"last": out.get("history", [{}])[-1], "seconds": round(time.time() - t0, 1)}


def train_verifiers(init: Path, train: dict[str, Any], s: dict[str, Any], out: Path, seed: int,
                    threads: int, jobs: int) -> dict[str, Any]:
    """Stage 3: ORM and PRM from the same checkpoint ``init``, same steps / batch / lr.

    ``jobs`` >= 2: the two train at the same time in two spawned processes with
    ``max(1, threads // 2)`` threads each (the two jobs share nothing; on a 2-core machine this
    halves the stage), else one after the other in this process with ``threads``.
    """
    common = {"model": str(init), "seed": seed, "max_steps": s["rm_steps"],
              "batch_size": s["rm_batch"], "micro_batch_size": s["rm_batch"], "lr": s["rm_lr"],
              "lr_schedule": "cosine", "warmup_steps": s["rm_steps"] // 10, "progress": False,
              "max_seq_len": 128}
    specs = {"orm": {**common, "objective": "binary", "train_data": train["orm"],
                     "out_dir": str(out / "orm")},
             "prm": {**common, "train_data": train["prm"], "out_dir": str(out / "prm")}}
    if jobs >= 2:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        each = max(1, threads // 2)
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {k: pool.submit(train_one, k, {**v, "threads": each})
                       for k, v in specs.items()}
            done = {k: f.result() for k, f in futures.items()}
    else:
        done = {k: train_one(k, {**v, "threads": threads}) for k, v in specs.items()}
    return {"orm_dir": str(out / "orm" / "final"), "prm_dir": str(out / "prm" / "final"),
            "orm_seconds": done["orm"]["seconds"], "prm_seconds": done["prm"]["seconds"],
            "orm_train": done["orm"]["last"], "prm_train": done["prm"]["last"],
            "parallel": jobs >= 2}


def step_f1(prm: Any, samples: Any) -> dict[str, float]:
    """Bad-step F1 of the PRM against exact labels of the held-out samples' steps (split by the
    PRM's own saved rule)."""
    from posttrain.search.metrics import step_metrics
    from posttrain.tasks.step_labels import exact_labels

    prompts, steps, labels = [], [], []
    for prompt, row in zip(samples.prompts, samples.completions, strict=True):
        for c in row:
            st = prm.split(c)
            if st:
                prompts.append(prompt)
                steps.append(st)
                labels.append(exact_labels(prompt, st))
    scores = []
    for start in range(0, len(steps), 1024):
        scores += prm(prompts[start:start + 1024], steps[start:start + 1024])
    return step_metrics(scores, labels)


def evaluate(policy: Any, tok: Any, verifiers: dict[str, Any], s: dict[str, Any], seed: int
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stage 4: sample, score, select; beam search. Returns (results, details)."""
    from posttrain.rewards.math import extract_answer
    from posttrain.search import (
        PolicyProposer,
        evaluate_selection,
        prm_beam_search,
        prm_outcome,
        sample_solutions,
        score_samples,
    )
    from posttrain.search.measure import is_correct
    from posttrain.search.metrics import pair_accuracy, pooled_auc
    from posttrain.search.verifiers import load_orm_scorer, load_prm_scorer
    from posttrain.tasks.arithmetic import heldout_rows

    rows = heldout_rows(s["heldout"], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    t0 = time.time()
    samples = sample_solutions(policy, tok, rows, s["n_max"], max_new_tokens=s["max_new_tokens"],
                               generator=gen)
    t1 = time.time()
    orm = load_orm_scorer(verifiers["orm_dir"])
    prm_steps = load_prm_scorer(verifiers["prm_dir"])
    scores = {"orm": score_samples(samples, orm),
              "prm": score_samples(samples, prm_outcome(prm_steps, s.get("aggregate", "prod")))}
    t2 = time.time()
    n_values = [n for n in N_VALUES if n <= s["n_max"]]
    sel = evaluate_selection(samples, n_values, scores)
    propose = PolicyProposer(policy, tok, max_step_tokens=s["max_new_tokens"], generator=gen)
    beam = prm_beam_search([r["prompt"] for r in rows], propose, prm_steps,
                           beam_width=s["beam_width"], expansions=s["expansions"],
                           aggregate=s.get("aggregate", "prod"))
    beam_correct = [is_correct(extract_answer(b.completion), r["answer"])
                    for b, r in zip(beam, rows, strict=True)]
    t3 = time.time()
    f1 = step_f1(prm_steps, samples)

    def acc(method: str) -> dict[str, float]:
        return {str(n): round(sel[method][n]["accuracy"], 4) for n in n_values}

    results = {"orm": acc("best_of_n:orm"), "prm": acc("best_of_n:prm"),
               "majority": acc("majority"), "weighted": acc("weighted:prm"),
               "prm_beam": round(sum(beam_correct) / len(beam_correct), 4),
               "orm_pair_accuracy": _finite(pair_accuracy(scores["orm"], samples.correct)),
               "prm_step_f1": round(f1["bad_f1"], 4)}
    details = {
        "selection": {m: {str(n): v for n, v in by_n.items()} for m, by_n in sel.items()},
        "beam": {"accuracy": results["prm_beam"],
                 "tokens": sum(b.tokens for b in beam) / len(beam),
                 "rounds_mean": sum(b.rounds for b in beam) / len(beam),
                 "no_solution": sum(not b.completion for b in beam),
                 "beam_width": s["beam_width"], "expansions": s["expansions"]},
        "prm_step_metrics": f1, "orm_auc": _finite(pooled_auc(scores["orm"], samples.correct)),
        "heldout_problems": len(rows), "sample_accuracy": sel["majority"][1]["accuracy"],
        "seconds": {"sample": round(t1 - t0, 1), "score": round(t2 - t1, 1),
                    "select_and_beam": round(t3 - t2, 1)},
    }
    return results, details


def plot(results: dict[str, Any], details: dict[str, Any], png: Path) -> None:
    """Accuracy vs N (log2 x), one line per method; beam at its token-matched N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"orm": "ORM best-of-N", "prm": "PRM best-of-N", "majority": "majority vote",
              "weighted": "PRM-weighted vote"}
    for key, label in labels.items():
        ns = [int(n) for n in results[key]]
        ax.plot(ns, [results[key][str(n)] for n in ns], marker="o", label=label)
    oracle = details["selection"]["oracle"]
    ns = [int(n) for n in oracle]
    ax.plot(ns, [oracle[str(n)]["accuracy"] for n in ns], "k--", alpha=0.4, label="pass@N")
    per_sample = details["selection"]["majority"]["1"]["tokens"]
    n_eq = details["beam"]["tokens"] / max(per_sample, 1e-9)
    ax.plot([n_eq], [results["prm_beam"]], "r*", markersize=12,
            label=f"PRM beam search ({n_eq:.0f} samples' tokens)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (solutions per problem; beam: generated tokens / tokens per solution)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("ORM vs PRM on the arithmetic task")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _finite(x: float) -> float | None:
    """Rounded, or None for nan (no pair to compare): JSON has no NaN."""
    return None if x != x else round(x, 4)


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (load-independent)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="small settings (<= 10 min)")
    parser.add_argument("--world", default="", help="reuse DIR/sft/final instead of training")
    parser.add_argument("--verifier-init", default="",
                        help="checkpoint both verifiers start from (default: the SFT policy)")
    parser.add_argument("--reuse-verifiers", action="store_true",
                        help="skip stages 2-3 when OUT/orm/final and OUT/prm/final exist")
    parser.add_argument("--aggregate", default="prod", choices=["prod", "min", "last", "mean"],
                        help="PRM step-score aggregation (best-of-N, weighted vote, beam)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch threads of the world/SFT, sampling and search stages")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help=">= 2: train the ORM and the PRM at the same time in two processes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    s = dict(SETTINGS["quick" if args.quick else "full"], aggregate=args.aggregate)
    if args.verifier_init and not Path(args.verifier_init, "config.json").is_file():
        sys.exit(f"--verifier-init {args.verifier_init}: no checkpoint there (expected "
                 "config.json)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    timings: dict[str, float] = {}
    if args.world:
        sft = Path(args.world) / "sft" / "final"
        if not (sft / "config.json").is_file():
            sys.exit(f"--world {args.world}: no SFT checkpoint at {sft} (expected config.json)")
    else:
        print(f"[orm_vs_prm] 1/4 world + SFT ({s['sft_steps']} steps) in {out}", flush=True)
        sft = build_world(out, s, args.seed, args.threads)
    timings["world"] = round(time.time() - start, 1)
    init = Path(args.verifier_init) if args.verifier_init else sft
    from posttrain.models.loading import load_model_and_tokenizer

    policy, tok = load_model_and_tokenizer(sft)
    reuse = {"orm_dir": str(out / "orm" / "final"), "prm_dir": str(out / "prm" / "final")}
    if args.reuse_verifiers and all(Path(p, "config.json").is_file() for p in reuse.values()):
        print("[orm_vs_prm] 2-3/4 reusing the trained ORM and PRM in", out, flush=True)
        train, verifiers = {"reused": True}, reuse
    else:
        print("[orm_vs_prm] 2/4 sampling verifier training data", flush=True)
        train = verifier_rows(policy, tok, s, args.seed, out / "data")
        timings["verifier_data"] = round(time.time() - start - sum(timings.values()), 1)
        print(f"[orm_vs_prm] 3/4 training ORM and PRM ({train['samples']} samples, "
              f"{train['correct_rate']:.2f} correct)", flush=True)
        verifiers = train_verifiers(init, train, s, out, args.seed, args.threads,
                                    args.jobs)
        timings["verifiers"] = round(time.time() - start - sum(timings.values()), 1)
    print("[orm_vs_prm] 4/4 held-out search", flush=True)
    results, details = evaluate(policy, tok, verifiers, s, args.seed)
    timings["evaluate"] = round(time.time() - start - sum(timings.values()), 1)
    details.update(settings=s, quick=args.quick, sft=str(sft), verifier_init=str(init),
                   train=train, verifiers=verifiers,
                   stage_seconds=timings, total_seconds=round(time.time() - start, 1),
                   cpu_seconds=round(_cpu_seconds(), 1), load_average=os.getloadavg(),
                   threads=args.threads, jobs=args.jobs, paper=PAPER)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "details.json").write_text(json.dumps(details, indent=2, default=str) + "\n")
    plot(results, details, out / "accuracy_vs_n.png")
    print(json.dumps(results))
    print(f"wrote {out / 'results.json'}, {out / 'details.json'}, {out / 'accuracy_vs_n.png'} "
          f"in {details['total_seconds']:.0f} s wall, {details['cpu_seconds']:.0f} s CPU")
    return results


if __name__ == "__main__":
    main()
