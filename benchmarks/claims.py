"""Every claim of docs/results.md, with >= 3 seeds: mean, standard deviation and per-seed values.

    python benchmarks/claims.py --quick --out runs/claims_quick    # sized for < 30 min, 2 cores
    python benchmarks/claims.py --out runs/claims                  # larger budgets, 3 seeds
    python benchmarks/claims.py --quick --out DIR --only dpo,ppo   # some claims (table: all done)
    python benchmarks/claims.py --out DIR --only verifiers --seed 3   # one more seed, full budget
    python benchmarks/claims.py --out DIR --only demo,verifiers,process --split hard   # hard split

1. One demo world and SFT start (``posttrain demo``'s settings, world seed 0), shared by every
   claim and seed: each claim is about the post-training stage that starts from that model, and
   the seed varies everything that stage draws (see ``SEEDED``); the SFT run's own variance is
   not measured here. ``--demo DIR`` reuses ``posttrain demo --out DIR``'s ``sft/final`` + ``data``.
2. Per seed S (jobs in parallel processes, one torch thread each), the recipes' settings with
   ``seed=S`` and the budgets of ``SETTINGS``:
   ``demo``  GRPO, the demo's settings (outcome reward), then the k1 / k3 KL estimators on its
             own rollouts against the exact KL (full distributions over the vocabulary);
   ``dpo``   recipes/dpo_arith.yaml on sign pairs written with seed S;
   ``ppo``   recipes/ppo_arith.yaml;
   ``verifiers`` exact step labels of the SFT policy's own samples (seed S), an ORM
             (recipes/rm_arith.yaml, Bradley-Terry on pairs of those samples) and a PRM
             (recipes/prm_arith.yaml), best-of-N at N = 1, 4, 16, 64 on held-out samples and
             its error analysis (``claims_verifiers.py``); Math-Shepherd (Monte Carlo) labels
             for the first rows against exact ones, and a PRM on each; PRMs at the smaller
             training budgets of ``prm_budgets`` (steps, label rows), their bad-step F1;
   ``process`` recipes/grpo_process.yaml (PRM only) and recipes/grpo_prm_rlvr.yaml on seed S's
             PRM, the same steps; the outcome arm is the ``demo`` run (same settings, math reward)
             at the same step (its eval there: constant learning rate);
   ``overopt`` recipes/ppo_rm_arith.yaml on seed S's ORM.
3. ``DIR/claims.json`` and ``DIR/claims.md``: one row per claim metric, per-seed values, mean,
   sample standard deviation (n - 1), the summed seconds of its runs and its command.
Each finished (job, seed) is cached in ``DIR/jobs/`` (``JOB_sS.json``; ``JOB_hard_sS.json`` on
the hard split); a rerun reuses it (delete to redo). ``--split hard`` runs ``demo``,
``verifiers`` and ``process`` on the arithmetic task's hard split (``difficulty="hard"`` of
``posttrain.tasks.arithmetic``: 4 operations, multipliers up to 9, values up to 99): its own
prompts, held-out problems, labels and verifiers, 64 new tokens; ``--split easy,hard`` runs both.
The table holds the rows of every cached job of both splits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's posttrain

SEEDED = ("data order (the trainers' seed), sampling (per-sequence seeds from the seed), the "
          "initialisation of new heads (the RM / PRM score head; PPO's value head is zero) and "
          "the seed's own data (DPO pairs, the verifiers' samples, held-out search samples)")
SETTINGS: dict[str, dict[str, Any]] = {
    "quick": {"seeds": [0, 1, 2], "eval_size": 200, "grpo_steps": 30, "dpo_steps": 40,
              "ppo_steps": 20, "label_prompts": 600, "label_heldout": 100, "offline_pairs": 0,
              "rm_steps": 150, "prm_steps": 150, "bon_problems": 100, "bon_n": 16,
              "shepherd_rows": 300, "shepherd_k": 4, "shepherd_prm_steps": 100,
              "prm_budgets": [], "process_steps": 30, "overopt_steps": 20, "kl_prompts": 64},
    "full": {"seeds": [0, 1, 2], "eval_size": 1000, "grpo_steps": 60, "dpo_steps": 100,
             "ppo_steps": 20, "label_prompts": 2000, "label_heldout": 300, "offline_pairs": 0,
             "rm_steps": 400, "prm_steps": 400, "bon_problems": 200, "bon_n": 64,
             "shepherd_rows": 1600, "shepherd_k": 4, "shepherd_prm_steps": 150,
             "prm_budgets": [[100, 0], [200, 0], [400, 2000]],  # [steps, label rows (0: all)]
             "process_steps": 40, "overopt_steps": 40, "kl_prompts": 128},
}
JOBS = ("demo", "dpo", "ppo", "verifiers", "process", "overopt")
NEEDS = {"process": "verifiers", "overopt": "verifiers"}
SPLITS = {"easy": {"jobs": JOBS, "max_new_tokens": 48},  # new tokens: sampling and evaluation
          "hard": {"jobs": ("demo", "verifiers", "process"), "max_new_tokens": 64}}


def job_id(job: str, split: str) -> str:
    """A job's name in ``DIR/jobs`` and its run folder: ``verifiers``, ``verifiers_hard``."""
    return job if split == "easy" else f"{job}_{split}"


# ---------------------------------------------------------------------------------------------
# the table arithmetic
# ---------------------------------------------------------------------------------------------
def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var)


def table_rows(per_seed: dict[str, dict[int, dict[str, Any]]], metrics: list[dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """One row per metric: ``{claim, metric, values (by seed), mean, std, seconds, command}``.

    ``per_seed[job][seed]`` holds that job's results (and ``seconds``); a metric names its job
    and key (``key`` a function of the result dict, or a name in it). A metric that some run
    lacks (a cache written before the metric existed) has no row."""
    rows = []
    for m in metrics:
        runs = per_seed.get(m["job"], {})
        if not runs:
            continue
        key = m["key"]
        try:
            values = {s: float(key(r) if callable(key) else r[key])
                      for s, r in sorted(runs.items())}
        except KeyError:
            continue
        mean, std = mean_std(list(values.values()))
        rows.append({"claim": m["claim"], "metric": m["metric"], "values": values,
                     "mean": mean, "std": std, "scale": m.get("scale", 1.0),
                     "seconds": round(sum(r["seconds"] for r in runs.values()), 1),
                     "command": m["command"]})
    return rows


def markdown(rows: list[dict[str, Any]], seeds: list[int]) -> str:
    """The table as Markdown; percentages where ``scale`` is 100."""
    def fmt(x: float, scale: float) -> str:
        return f"{x * scale:.1f}" if scale == 100 else f"{x * scale:.4g}"

    head = ("| claim | metric | mean | std | " + " | ".join(f"seed {s}" for s in seeds)
            + " | seconds | command |")
    lines = [head, "|" + "---|" * (len(seeds) + 6)]
    for r in rows:
        vals = " | ".join(fmt(r["values"][s], r["scale"]) if s in r["values"] else ""
                          for s in seeds)
        lines.append(f"| {r['claim']} | {r['metric']} | **{fmt(r['mean'], r['scale'])}** | "
                     f"{fmt(r['std'], r['scale'])} | {vals} | {r['seconds']} | "
                     f"`{r['command']}` |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# the jobs (each runs in its own process: picklable arguments and results)
# ---------------------------------------------------------------------------------------------
def _train(kind: str, recipe: str, keys: dict[str, Any]) -> dict[str, Any]:
    from posttrain.config import DPOConfig, GRPOConfig, PPOConfig, PRMConfig, RMConfig, build_config
    from posttrain.core.io import finished
    from posttrain.trainers.dpo import DPOTrainer
    from posttrain.trainers.grpo import GRPOTrainer
    from posttrain.trainers.ppo import PPOTrainer
    from posttrain.trainers.prm import PRMTrainer
    from posttrain.trainers.reward_model import RewardModelTrainer

    classes = {"grpo": (GRPOConfig, GRPOTrainer), "dpo": (DPOConfig, DPOTrainer),
               "ppo": (PPOConfig, PPOTrainer), "rm": (RMConfig, RewardModelTrainer),
               "prm": (PRMConfig, PRMTrainer)}
    config, trainer = classes[kind]
    cfg = build_config(config, str(ROOT / "recipes" / recipe) if recipe else None,
                       overrides={"progress": False, "threads": 1, "overwrite": True, **keys})
    return finished(trainer(cfg).train(), f"{kind} ({recipe})")


def _rl_keys(world: dict[str, str], s: dict[str, Any], out: Path, seed: int, steps: int
             ) -> dict[str, Any]:
    split = s.get("split", "easy")
    tokens = SPLITS[split]["max_new_tokens"]
    return {"model": world["sft"], "train_data": f"{world['data']}/prompts.jsonl",
            "eval_data": f"{world['data']}/heldout.jsonl", "eval_size": s["eval_size"],
            "out_dir": str(out), "seed": seed, "max_steps": steps, "eval_every": 10,
            **({} if split == "easy" else {"max_new_tokens": tokens,
                                           "eval_max_new_tokens": tokens})}


def split_world(world: dict[str, str], split: str, out: Path) -> dict[str, str]:
    """The world of ``split``: the easy one is the demo's; another writes its prompts
    (20,000, seed 1) and held-out problems (1,000, seed 0) as the demo's world does, at that
    difficulty, into ``out/data_<split>`` (deterministic; written once, atomically)."""
    if split == "easy":
        return world
    from posttrain.tasks.arithmetic import heldout_rows, prompt_rows, write_jsonl

    data = out / f"data_{split}"
    for name, rows in (("prompts", lambda: prompt_rows(20_000, 1, difficulty=split)),
                       ("heldout", lambda: heldout_rows(1000, 0, difficulty=split))):
        if not (data / f"{name}.jsonl").is_file():
            tmp = write_jsonl(rows(), data / f"{name}.{os.getpid()}.tmp")
            os.replace(tmp, data / f"{name}.jsonl")
    return {**world, "data": str(data)}


def job_demo(world: dict[str, str], s: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    """The demo's GRPO from the shared SFT start, then k1 / k3 against the exact KL."""
    from process_rl import curves

    from posttrain.demo import DEMO

    keys = {**DEMO["grpo"], **_rl_keys(world, s, out / "grpo", seed, s["grpo_steps"])}
    run = _train("grpo", "", keys)
    kl = kl_estimators(str(out / "grpo" / "final"), world, s["kl_prompts"], seed,
                       SPLITS[s.get("split", "easy")]["max_new_tokens"])
    return {"before": run["eval_before"], "after": run["eval_after"],
            "gain": run["eval_after"] - run["eval_before"], **kl,
            "curve": curves(out / "grpo" / "metrics.jsonl")["curve"]}


def kl_estimators(policy_dir: str, world: dict[str, str], n_prompts: int, seed: int,
                  max_new_tokens: int = 48) -> dict[str, float]:
    """Per-token k1 = d and k3 = exp(-d) + d - 1 (d = log pi(y_t) - log ref(y_t), unclamped) on
    the policy's own samples (training prompts, 8 per prompt, temperature 1), against the exact
    KL(pi || ref) at the same positions from the full distributions over the vocabulary.

    Each estimator's expectation given the prefix is that position's exact KL, so their means
    over tokens estimate the mean exact KL; ``var_*`` is the variance over tokens of the
    estimate, ``err_var_*`` that of (estimate - exact KL) at the token."""
    import torch

    from posttrain.data.prompts import render_prompt
    from posttrain.models import load_model_and_tokenizer
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.sampler import model_sampler

    policy, tok = load_model_and_tokenizer(policy_dir)
    ref, _ = load_model_and_tokenizer(world["sft"])
    rows = [json.loads(x) for x in Path(world["data"], "prompts.jsonl").read_text().splitlines()]
    prompts = [render_prompt(tok, r["prompt"]) for r in rows[-n_prompts:]]  # not trained on
    out = model_sampler(policy, tok).generate(
        prompts, group_size=8, params=SamplingParams(max_new_tokens=max_new_tokens,
                                                     temperature=1.0),
        generator=torch.Generator().manual_seed(seed))
    exact, d, sampler_gap = [], [], []
    with torch.no_grad():
        for i in range(out.completion_ids.shape[0]):
            p = out.prompt_ids[i][out.prompt_mask[i].bool()]
            c = out.completion_ids[i][out.response_mask[i].bool()]
            ids = torch.cat([p, c])[None]
            lp = torch.log_softmax(policy(ids).logits[0, len(p) - 1:-1].float(), -1)  # [T, V]
            lr = torch.log_softmax(ref(ids).logits[0, len(p) - 1:-1].float(), -1)  # [T, V]
            exact.append((lp.exp() * (lp - lr)).sum(-1))  # [T]
            tok_lp = lp.gather(-1, c[:, None])[:, 0]
            d.append(tok_lp - lr.gather(-1, c[:, None])[:, 0])
            sampler_gap.append((tok_lp - out.logprobs[i][out.response_mask[i].bool()]).abs())
    exact_t, d_t = torch.cat(exact).double(), torch.cat(d).double()
    k1, k3 = d_t, torch.expm1(-d_t) + d_t
    return {"kl_tokens": int(d_t.numel()), "kl_exact": float(exact_t.mean()),
            "k1_mean": float(k1.mean()), "k3_mean": float(k3.mean()),
            "k1_var": float(k1.var()), "k3_var": float(k3.var()),
            "k1_err_var": float((k1 - exact_t).var()), "k3_err_var": float((k3 - exact_t).var()),
            "sampler_gap_max": float(torch.cat(sampler_gap).max())}


def job_dpo(world: dict[str, str], s: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    """recipes/dpo_arith.yaml on sign pairs written with this seed."""
    from posttrain.tasks.arithmetic import write_jsonl
    from posttrain.tasks.preferences import offline_pairs

    n = 64 * s["dpo_steps"]  # one pass (batch 64); the recipe's 4,000 pairs at 100 steps
    train = write_jsonl(offline_pairs(n, seed, kind="sign"), out / "pref_train.jsonl")
    held = write_jsonl(offline_pairs(500, seed, kind="sign", split="heldout"),
                       out / "pref_heldout.jsonl")
    run = _train("dpo", "dpo_arith.yaml", {
        "model": world["sft"], "train_data": str(train), "eval_pref_data": str(held),
        "eval_data": f"{world['data']}/heldout.jsonl", "eval_size": s["eval_size"],
        "out_dir": str(out / "dpo"), "seed": seed, "max_steps": s["dpo_steps"],
        "eval_every": 0})
    return {"before": run["eval_before"], "after": run["eval_after"]}


def job_ppo(world: dict[str, str], s: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    """recipes/ppo_arith.yaml."""
    run = _train("ppo", "ppo_arith.yaml", _rl_keys(world, s, out / "ppo", seed, s["ppo_steps"]))
    return {"before": run["eval_before"], "after": run["eval_after"]}


def job_verifiers(world: dict[str, str], s: dict[str, Any], out: Path, seed: int
                  ) -> dict[str, Any]:
    """Exact step labels of seed S's samples -> ORM + PRM; best-of-N and its error analysis;
    the PRM's F1 at smaller budgets; Monte Carlo vs exact labels (``claims_verifiers``)."""
    from claims_verifiers import verifiers_job

    return verifiers_job(world, s, out, seed, _train,
                         SPLITS[s.get("split", "easy")]["max_new_tokens"])



def _watch(metrics: Path, key: str, k: int = 5) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last ``k`` training steps of a run."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return float("nan"), float("nan")
    return sum(vals[:k]) / len(vals[:k]), sum(vals[-k:]) / len(vals[-k:])


def verifier_model(out: Path, s: dict[str, Any], seed: int, kind: str) -> str:
    """The ``orm`` / ``prm`` that seed S's verifiers job trained on the same split."""
    return str(out.parent / f"{job_id('verifiers', s.get('split', 'easy'))}_s{seed}" / kind
               / "final")


def job_process(world: dict[str, str], s: dict[str, Any], out: Path, seed: int
                ) -> dict[str, Any]:
    """Process-only GRPO and PRM + RLVR on seed S's PRM, the same steps."""
    prm = verifier_model(out, s, seed, "prm")
    result: dict[str, Any] = {}
    for arm, recipe in (("process", "grpo_process.yaml"), ("prm_rlvr", "grpo_prm_rlvr.yaml")):
        run = _train("grpo", recipe, {**_rl_keys(world, s, out / arm, seed, s["process_steps"]),
                                      "process_reward_model": prm})
        from process_rl import curves

        curve = curves(out / arm / "metrics.jsonl")["curve"]
        peak = max(curve, key=lambda sa: sa[1])
        result.update({f"{arm}_after": run["eval_after"], f"{arm}_peak": peak[1],
                       f"{arm}_peak_step": peak[0], f"{arm}_curve": curve})
        for key, name in (("reward/verifier_accuracy", "verifier"),
                          ("process/step_score_mean", "prm_score")):
            first, last = _watch(out / arm / "metrics.jsonl", key)
            result.update({f"{arm}_{name}_first": first, f"{arm}_{name}_last": last})
    return result


def job_overopt(world: dict[str, str], s: dict[str, Any], out: Path, seed: int
                ) -> dict[str, Any]:
    """recipes/ppo_rm_arith.yaml: PPO on seed S's ORM score, the verifier watched at weight 0."""
    from process_rl import curves

    orm = verifier_model(out, s, seed, "orm")
    run = _train("ppo", "ppo_rm_arith.yaml", {
        **_rl_keys(world, s, out / "ppo_rm", seed, s["overopt_steps"]),
        "rewards": [{"name": "math", "weight": 0.0},
                    {"name": "reward_model", "path": orm, "weight": 1.0}],
        "critic_model": orm})
    metrics = out / "ppo_rm" / "metrics.jsonl"
    curve = curves(metrics)["curve"]
    peak = max(curve, key=lambda sa: sa[1])
    proxy, gold, kl = (_watch(metrics, k, 3) for k in ("reward/reward_model_mean",
                                                        "reward/math_mean", "kl/mean"))
    return {"before": run["eval_before"], "after": run["eval_after"], "peak": peak[1],
            "peak_step": peak[0], "curve": curve, "proxy_first": proxy[0],
            "proxy_last": proxy[1], "gold_first": gold[0], "gold_last": gold[1],
            "kl_last": kl[1]}


# ---------------------------------------------------------------------------------------------
# the rows of the table
# ---------------------------------------------------------------------------------------------
def metrics(s: dict[str, Any], cmd: str) -> list[dict[str, Any]]:
    """What each claim's row reports, the easy split's rows, then the hard split's."""
    return [row for split in SPLITS for row in split_metrics(s, cmd, split)]


def split_metrics(s: dict[str, Any], cmd: str, split: str) -> list[dict[str, Any]]:
    """The rows of one split's jobs (``scale`` 100: shown as a percentage / points); a hard
    split row says so in its claim and its command."""
    from claims_verifiers import verifier_metrics

    tag, flag = ("", "") if split == "easy" else (f" [{split} split]", f" --split {split}")

    def m(job: str, claim: str, metric: str, key: Any, scale: float = 1.0) -> dict[str, Any]:
        return {"job": job_id(job, split), "claim": claim + tag, "metric": metric, "key": key,
                "scale": scale, "command": f"{cmd} --only {job}{flag}"}

    g, p = s["grpo_steps"], s["process_steps"]
    demo = f"demo: GRPO {g} steps from the SFT start"
    proc = f"process-only GRPO vs PRM + RLVR, {p} steps"
    over = f"PPO on a learned ORM, {s['overopt_steps']} steps"
    kl = "KL estimators on the demo's rollouts (GRPO policy vs SFT)"
    rows = [
        m("demo", demo, "SFT held-out accuracy %", "before", 100),
        m("demo", demo, "GRPO held-out accuracy %", "after", 100),
        m("demo", demo, "gain (points)", "gain", 100),
        m("dpo", f"DPO {s['dpo_steps']} steps (dpo_arith)", "held-out accuracy %", "after", 100),
        m("ppo", f"PPO {s['ppo_steps']} steps (ppo_arith)", "held-out accuracy %", "after", 100),
        *verifier_metrics(s, m),
        m("process", proc, f"outcome only (the demo run at step {p}) %", None, 100),
        m("process", proc, "process only, final %", "process_after", 100),
        m("process", proc, "process only, best eval %", "process_peak", 100),
        m("process", proc, "PRM + RLVR, final %", "prm_rlvr_after", 100),
        m("process", proc, "PRM + RLVR - process only (points)",
          lambda r: r["prm_rlvr_after"] - r["process_after"], 100),
        m("process", proc, "process only: verifier acc. on samples, last 5 - first 5 steps",
          lambda r: r["process_verifier_last"] - r["process_verifier_first"]),
        m("process", proc, "process only: PRM step score, last 5 - first 5 steps",
          lambda r: r["process_prm_score_last"] - r["process_prm_score_first"]),
        m("overopt", over, "held-out accuracy, start %", "before", 100),
        m("overopt", over, "held-out accuracy, best eval %", "peak", 100),
        m("overopt", over, "held-out accuracy, final %", "after", 100),
        m("overopt", over, "proxy (ORM score), last 3 - first 3 steps",
          lambda r: r["proxy_last"] - r["proxy_first"]),
        m("overopt", over, "gold (verifier on samples), last 3 - first 3 steps",
          lambda r: r["gold_last"] - r["gold_first"]),
        m("demo", kl, "exact KL, mean per token", "kl_exact"),
        m("demo", kl, "k1, mean per token", "k1_mean"),
        m("demo", kl, "k3, mean per token", "k3_mean"),
        m("demo", kl, "k1 variance over tokens", "k1_var"),
        m("demo", kl, "k3 variance over tokens", "k3_var"),
        m("demo", kl, "var(k1) / var(k3)", lambda r: r["k1_var"] / r["k3_var"]),
    ]
    ran = {job_id(j, split) for j in SPLITS[split]["jobs"]}
    return [r for r in rows if r["job"] in ran]


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------
def run_job(job: str, split: str, world: dict[str, str], s: dict[str, Any], out: Path,
            seed: int) -> dict[str, Any]:
    """One (job, split, seed) in this process, one torch thread; cached in ``out/jobs``."""
    import torch

    torch.set_num_threads(1)
    name = job_id(job, split)
    cache = out / "jobs" / f"{name}_s{seed}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    t, load = time.time(), os.getloadavg()[0]
    try:
        result = globals()[f"job_{job}"](split_world(world, split, out), {**s, "split": split},
                                         out / f"{name}_s{seed}", seed)
    except Exception as exc:  # library errors may not pickle across the process pool
        raise RuntimeError(f"claims: job {name} seed {seed}: {type(exc).__name__}: {exc}"
                           ) from None
    result.update(seconds=round(time.time() - t, 1), load=[round(load, 2),
                                                           round(os.getloadavg()[0], 2)])
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result, indent=1))
    print(f"[claims] {name} seed {seed}: {result['seconds']} s", flush=True)
    return result


def run_all(units: list[tuple[str, str]], world: dict[str, str], s: dict[str, Any], out: Path,
            workers: int) -> dict[str, dict[int, dict[str, Any]]]:
    """Every (job, split) of ``units`` and seed; ``process`` / ``overopt`` start when the
    verifiers of their split and seed are done. Results by ``job_id`` and seed."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    done: dict[str, dict[int, dict[str, Any]]] = {job_id(*u): {} for u in units}
    order = sorted(units, key=lambda u: (u[0] in NEEDS, u[0] != "verifiers"))
    if workers <= 1:  # in this process, in dependency order
        for job, split in order:
            for seed in s["seeds"]:
                done[job_id(job, split)][seed] = run_job(job, split, world, s, out, seed)
        return done
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        pending = {}
        for job, split in order:
            for seed in s["seeds"]:
                if job in NEEDS and (NEEDS[job], split) in units:
                    continue  # submitted when its verifiers finish
                pending[pool.submit(run_job, job, split, world, s, out, seed)] = (job, split,
                                                                                 seed)
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                job, split, seed = pending.pop(f)
                done[job_id(job, split)][seed] = f.result()
                for later, need in NEEDS.items():
                    if need == job and (later, split) in units:
                        pending[pool.submit(run_job, later, split, world, s, out, seed)] = (
                            later, split, seed)
    return done


def shared_world(out: Path, demo: str) -> dict[str, Any]:
    """The shared SFT start: ``--demo DIR``, a cached one in ``out``, or built now (1 thread:
    on a loaded 2-core machine two threads per process stall each other)."""
    if demo:
        return {"sft": f"{demo}/sft/final", "data": f"{demo}/data", "seconds": 0.0,
                "reused": demo}
    cache = out / "jobs" / "sft.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    from process_rl import build_sft

    t = time.time()
    world = {**build_sft(out / "demo", 0, threads=1), "seconds": round(time.time() - t, 1)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(world))
    return world


def parse(argv: list[str] | None = None
          ) -> tuple[argparse.Namespace, dict[str, Any], list[tuple[str, str]]]:
    """The arguments, the settings (``SETTINGS`` of the budget, ``--set``, the seeds) and the
    (job, split) units to run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="the smallest budgets")
    ap.add_argument("--only", default=",".join(JOBS), help=f"jobs, comma-separated: {JOBS}")
    ap.add_argument("--split", default="easy",
                    help=f"task splits, comma-separated: {list(SPLITS)} (hard: "
                         f"{', '.join(SPLITS['hard']['jobs'])} only)")
    ap.add_argument("--demo", default="", help="reuse `posttrain demo --out DIR`'s SFT + data")
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", default="", help="comma-separated (default 0,1,2)")
    seeds.add_argument("--seed", type=int, default=None,
                       help="one seed (e.g. one not in the table); its table is written to "
                            "claims_seedS.md / .json, so the main table stays")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="parallel processes, one torch thread each")
    ap.add_argument("--set", default="{}", help="JSON overriding SETTINGS (e.g. tiny budgets)")
    ap.add_argument("--table", action="store_true", help="only write the table of the cached jobs")
    args = ap.parse_args(argv)
    s = {**SETTINGS["quick" if args.quick else "full"], **json.loads(args.set)}
    if args.seeds:
        s["seeds"] = [int(x) for x in args.seeds.split(",")]
    if args.seed is not None:
        s["seeds"] = [args.seed]
    jobs = [j for j in args.only.split(",") if j]
    splits = [x for x in args.split.split(",") if x]
    unknown = [j for j in jobs if j not in JOBS] + [x for x in splits if x not in SPLITS]
    if unknown:
        ap.error(f"unknown job(s) / split(s) {unknown}; jobs: {list(JOBS)}, splits: "
                 f"{list(SPLITS)}")
    missing = [(j, x) for x in splits for j in jobs if j not in SPLITS[x]["jobs"]]
    if missing:
        ap.error(f"not on that split: {missing}; the hard split runs {SPLITS['hard']['jobs']}")
    return args, s, [(j, x) for x in splits for j in jobs]


def outcome_at(demo: dict[str, Any], step: int) -> float:
    """The demo run's held-out accuracy at ``step`` (an eval of its curve; its learning rate is
    constant, so its first ``step`` steps are an outcome-only run of that length), else its
    final accuracy."""
    return next((a for st, a in demo.get("curve", []) if st == step), demo["after"])


def load_cached(out: Path, seeds: list[int], process_steps: int
                ) -> dict[str, dict[int, dict[str, Any]]]:
    """Every cached (job, seed) of both splits, by ``job_id``; a process row's outcome arm
    (``outcome_after``) is the demo run of its split and seed at ``process_steps``."""
    per_seed = {}
    for split, spec in SPLITS.items():
        for j in spec["jobs"]:
            files = {sd: out / "jobs" / f"{job_id(j, split)}_s{sd}.json" for sd in seeds}
            per_seed[job_id(j, split)] = {sd: json.loads(f.read_text())
                                          for sd, f in files.items() if f.is_file()}
        demo = per_seed.get(job_id("demo", split), {})
        for sd, r in per_seed.get(job_id("process", split), {}).items():
            if sd in demo:
                r["outcome_after"] = outcome_at(demo[sd], process_steps)
    return per_seed


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args, s, units = parse(argv)
    out = Path(args.out)
    start = time.time()
    world = shared_world(out, args.demo) if not args.table else {"seconds": float("nan")}
    if not args.table:
        run_all(units, world, s, out, args.jobs)
    per_seed = load_cached(out, s["seeds"], s["process_steps"])
    if args.table and not any(per_seed.values()):
        sys.exit(f"[claims] --table: no finished jobs in {out / 'jobs'} (seeds {s['seeds']}); "
                 f"run `python benchmarks/claims.py --out {out}` first")
    cmd = (f"python benchmarks/claims.py {'--quick ' if args.quick else ''}--out {out}"
           + (f" --seed {args.seed}" if args.seed is not None else ""))
    specs = metrics(s, cmd)
    for spec in specs:
        if spec["key"] is None:
            spec["key"] = "outcome_after"
    rows = table_rows(per_seed, specs)
    wall = round(time.time() - start, 1)
    info = {"settings": s, "world": world, "wall_seconds": wall, "load_end": os.getloadavg(),
            "job_seconds": sum(r["seconds"] for js in per_seed.values() for r in js.values()),
            "rows": rows}
    stem = "claims" if args.seed is None else f"claims_seed{args.seed}"
    (out / f"{stem}.json").write_text(json.dumps(info, indent=1, default=str))
    text = markdown(rows, s["seeds"])
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"[claims] wall {wall} s this call; job seconds summed {info['job_seconds']:.0f} "
          f"+ SFT {world['seconds']} s; wrote {out / f'{stem}.json'}, {out / f'{stem}.md'}")
    return rows


if __name__ == "__main__":
    main()
