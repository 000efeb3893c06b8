"""The ORM / PRM experiments of docs/reward_models.md ("ORM and PRM experiments"), one step a call.

Same functions and settings as ``benchmarks/orm_vs_prm.py`` stages 2-4, so each number can be
reproduced on its own (single thread; files under ``--dir``)::

    python benchmarks/verifier_runs.py --dir D data 16000 8 --name d16k   # policy samples, labels
    python benchmarks/verifier_runs.py --dir D heldout 200 64            # held-out samples
    python benchmarks/verifier_runs.py --dir D train orm orm_g3 D/d16k_orm.jsonl \\
        '{"model": "runs/demo/grpo/final", "max_steps": 2000, "batch_size": 64, "lr": 7e-4}'
    python benchmarks/verifier_runs.py --dir D evaluate orm_g3 orm       # pair accuracy, BoN

``--policy`` is the SFT policy whose samples are labelled and searched (default
``runs/demo/sft/final``). ``evaluate`` appends its numbers to ``D/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import torch


def data(policy: str, out: Path, n_problems: int, samples: int, seed: int, name: str) -> None:
    """Stage 2 of orm_vs_prm: the policy's own samples as ORM rows and exact-label PRM rows."""
    from orm_vs_prm import verifier_rows

    from posttrain.models.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(policy)
    s = {"train_problems": n_problems, "train_samples": samples, "max_new_tokens": 48}
    got = verifier_rows(model, tok, s, seed, out / name)
    print(json.dumps(got), os.getloadavg())


def heldout(policy: str, out: Path, n: int, n_max: int) -> None:
    """Stage 4's held-out samples (the same problems and generator seed as orm_vs_prm)."""
    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.search import sample_solutions
    from posttrain.tasks.arithmetic import heldout_rows

    model, tok = load_model_and_tokenizer(policy)
    samples = sample_solutions(model, tok, heldout_rows(n, 0), n_max, max_new_tokens=48,
                               generator=torch.Generator().manual_seed(1))
    with open(out / f"heldout_{n}x{n_max}.pkl", "wb") as f:
        pickle.dump(samples, f)


def train(policy: str, out: Path, kind: str, name: str, rows: str, over: dict[str, Any]) -> None:
    """Stage 3's trainer call for one verifier; ``over`` overrides the config."""
    from posttrain.config import PRMConfig, RMConfig, build_config
    from posttrain.trainers.prm import PRMTrainer
    from posttrain.trainers.reward_model import RewardModelTrainer

    cfg = {"model": policy, "seed": 0, "threads": 1, "max_steps": 400, "batch_size": 32,
           "lr": 2e-4, "lr_schedule": "cosine", "progress": False, "max_seq_len": 128,
           "out_dir": str(out / name), "train_data": rows, "eval_every": 0, **over}
    cfg.setdefault("micro_batch_size", cfg["batch_size"])
    cfg.setdefault("warmup_steps", cfg["max_steps"] // 10)
    t = time.time()
    if kind == "orm":
        trainer: Any = RewardModelTrainer(build_config(RMConfig, overrides={
            "objective": "binary", **cfg}))
    else:
        trainer = PRMTrainer(build_config(PRMConfig, overrides=cfg))
    trainer.train()
    print(name, "trained in", round(time.time() - t), "s, load", os.getloadavg())


def evaluate(out: Path, name: str, kind: str, held: str, aggregate: str) -> None:
    """Pair accuracy, pooled AUC, best-of-N / majority / weighted vote; PRM bad-step F1."""
    from orm_vs_prm import step_f1

    from posttrain.search import evaluate_selection, prm_outcome, score_samples
    from posttrain.search.metrics import pair_accuracy, pooled_auc
    from posttrain.search.verifiers import load_orm_scorer, load_prm_scorer

    with open(out / held, "rb") as f:
        s = pickle.load(f)
    if kind == "orm":
        scores = score_samples(s, load_orm_scorer(out / name / "final"))
    else:
        prm = load_prm_scorer(out / name / "final")
        scores = score_samples(s, prm_outcome(prm, aggregate))
    sel = evaluate_selection(s, [1, 4, 16, 64], {"v": scores})
    res: dict[str, Any] = {"name": name, "kind": kind,
                           "pair_acc": round(pair_accuracy(scores, s.correct), 4),
                           "auc": round(pooled_auc(scores, s.correct), 4)}
    for method in ("best_of_n:v", "majority", "weighted:v"):
        res.update({f"{method}@{n}": round(sel[method][n]["accuracy"], 3) for n in (1, 4, 16, 64)})
    if kind == "prm":
        res["f1"] = round(step_f1(prm, s)["bad_f1"], 4)
    print(json.dumps(res))
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--policy", default="runs/demo/sft/final")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("problems", type=int)
    d.add_argument("samples", type=int)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--name", default="data")
    h = sub.add_parser("heldout")
    h.add_argument("n", type=int)
    h.add_argument("n_max", type=int)
    t = sub.add_parser("train")
    t.add_argument("kind", choices=["orm", "prm"])
    t.add_argument("name")
    t.add_argument("rows")
    t.add_argument("overrides", nargs="?", default="{}")
    e = sub.add_parser("evaluate")
    e.add_argument("name")
    e.add_argument("kind", choices=["orm", "prm"])
    e.add_argument("--heldout", default="heldout_200x64.pkl")
    e.add_argument("--aggregate", default="prod")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    a.dir.mkdir(parents=True, exist_ok=True)
    if a.cmd == "data":
        data(a.policy, a.dir, a.problems, a.samples, a.seed, a.name)
    elif a.cmd == "heldout":
        heldout(a.policy, a.dir, a.n, a.n_max)
    elif a.cmd == "train":
        train(a.policy, a.dir, a.kind, a.name, a.rows, json.loads(a.overrides))
    else:
        evaluate(a.dir, a.name, a.kind, a.heldout, a.aggregate)


if __name__ == "__main__":
    main()
