"""The verifiers job of ``benchmarks/claims.py``: labels, ORM, PRM, best-of-N, error analysis.

Per seed S, on the job's split (``s["split"]``: the arithmetic task's ``easy`` or ``hard``
problems, ``posttrain.tasks.arithmetic.DIFFICULTIES``):

1. The SFT policy samples 4 solutions of each of ``label_prompts`` training problems (and
   ``label_heldout`` held-out ones); exact step labels (``posttrain.tasks.step_labels``).
2. An ORM (recipes/rm_arith.yaml: Bradley-Terry on correct-vs-wrong pairs of those samples) and a
   PRM (recipes/prm_arith.yaml on the exact labels), ``rm_steps`` / ``prm_steps`` steps.
3. Best-of-N on ``bon_problems`` held-out problems (below).
4. PRMs at smaller budgets (``prm_budgets``: [steps, label rows], rows 0 = all; the first rows
   are the first problems' samples), their bad-step F1 on the same held-out labels.
5. Math-Shepherd (Monte Carlo, K = ``shepherd_k``) labels of the first ``shepherd_rows``
   samples against their exact labels, and a PRM on each (``shepherd_prm_steps`` steps).

Best-of-N. Samples are drawn once per held-out problem at the largest N (``bon_n``); a
smaller N uses the same samples cut into disjoint groups of N
(``posttrain.search.evaluate_selection``): samples 1-N, N+1-2N, ... of each problem, so
``bon_n / N`` independent trials per problem. Every sample is scored once by the ORM (its
sigmoid) and once by the PRM (one probability per step); the PRM's outcome score is its step
scores aggregated three ways: ``min``, ``prod`` (Lightman et al. 2023, "Let's Verify Step by
Step": the probability that every step is correct) and ``last``.

Selectors (``bon_<method>@<N>`` in the job's JSON): ``majority`` (most frequent answer),
``orm`` / ``prm_min`` / ``prm_prod`` / ``prm_last`` (best-of-N: the highest score),
``weighted_prm_prod`` (PRM-weighted vote: the answer whose samples' product scores sum highest)
and ``pass`` (pass@N, the oracle: any of the N is right; the ceiling of every selector).

Error analysis (``err_<method>@<N>_*``) of best-of-N, majority and the weighted vote, over the
trials where the selector picks a wrong sample (or none: no sample has an answer), ``wrong`` of
them:

* ``missed``: the share of those wrong picks whose FIRST WRONG STEP the PRM scored as correct
  (step score >= 0.5). Steps are cut by the PRM's own rule and labelled exactly
  (``posttrain.tasks.step_labels.exact_labels``: the first step whose input, operation or result
  is wrong, or a wrong answer step); over the wrong picks that have such a step (nan when none
  has). Reported for every selector, the ORM's and majority's picks included: it says how many
  of each selector's errors the PRM itself would have let through.
* ``avoidable``: the share of those wrong picks whose group of N held a correct sample, i.e.
  the selector ranked a wrong sample above at least one correct sample it was choosing from
  (for best-of-N: scored it higher than every correct sample of the group). This is the
  ORM's comparable number: it measures the selector, not the policy (1 - avoidable of the
  wrong picks had no correct sample to find).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

N_VALUES = (1, 4, 16, 64)
AGGREGATES = ("min", "prod", "last")
ANALYSED_N = (16, 64)
THRESHOLD = 0.5
Train = Callable[[str, str, dict[str, Any]], dict[str, Any]]  # (kind, recipe, keys) -> summary


def bon_ns(bon_n: int) -> list[int]:
    """The N of the rows: 1, 4, 16, 64 up to ``bon_n`` (each must divide it)."""
    ns = [n for n in N_VALUES if n <= bon_n and bon_n % n == 0]
    if bon_n not in ns:
        ns.append(bon_n)
    return ns


def step_score_table(prm: Any, samples: Any, chunk: int = 1024) -> list[list[list[float]]]:
    """The PRM's score of every step of every sample, [P][N][steps] (steps by its own rule)."""
    flat_p = [p for p, row in zip(samples.prompts, samples.completions, strict=True) for _ in row]
    flat_c = [c for row in samples.completions for c in row]
    flat: list[list[float]] = []
    for start in range(0, len(flat_c), chunk):
        flat += prm.step_scores(flat_p[start:start + chunk], flat_c[start:start + chunk])
    out, i = [], 0
    for row in samples.completions:
        out.append(flat[i:i + len(row)])
        i += len(row)
    return out


def aggregate_table(steps: list[list[list[float]]], how: str) -> list[list[float]]:
    """[P][N] outcome scores from [P][N][steps] step scores (``posttrain.search`` rules)."""
    from posttrain.search import aggregate_scores

    return [aggregate_scores(row, how) for row in steps]


def selection_scores(orm: list[list[float]], steps: list[list[list[float]]]
                     ) -> dict[str, list[list[float]]]:
    """Scores by name: ``orm`` and ``prm_<aggregate>`` for each of :data:`AGGREGATES`."""
    return {"orm": orm, **{f"prm_{a}": aggregate_table(steps, a) for a in AGGREGATES}}


def bon_results(samples: Any, scores: dict[str, list[list[float]]], ns: Sequence[int]
                ) -> dict[str, float]:
    """``bon_<method>@<N>`` accuracies for every selector of the module doc."""
    from posttrain.search import evaluate_selection

    sel = evaluate_selection(samples, list(ns), scores)
    names = {"majority": "majority", "pass": "oracle", "weighted_prm_prod": "weighted:prm_prod",
             **{k: f"best_of_n:{k}" for k in scores}}
    return {f"bon_{name}@{n}": sel[method][n]["accuracy"]
            for name, method in names.items() for n in ns}


def first_wrong_step_missed(prompt: str, steps: list[str], step_scores: list[float]
                            ) -> bool | None:
    """Did the PRM score the first wrong step (exact labels) as correct? None when no step of
    the solution is wrong (it is then wrong by format only) or it has no step."""
    from posttrain.data.steps import first_error
    from posttrain.tasks.step_labels import exact_labels

    if not steps:
        return None
    f = first_error(exact_labels(prompt, steps))
    if f >= len(steps) or f >= len(step_scores):
        return None
    return step_scores[f] >= THRESHOLD


def picks(samples: Any, scores: dict[str, list[list[float]]], n: int
          ) -> dict[str, list[tuple[int, int, int | None]]]:
    """Per selector, its pick in every trial at N = ``n``: (problem, group start, index or
    None), groups as in ``evaluate_selection``."""
    from posttrain.search.measure import selectors

    methods = {k: v for k, v in selectors(scores).items()
               if k == "majority" or k.startswith("best_of_n:") or k == "weighted:prm_prod"}
    out: dict[str, list[tuple[int, int, int | None]]] = {}
    for name, (select, key) in methods.items():
        short = name.removeprefix("best_of_n:").replace("weighted:", "weighted_")
        out[short] = []
        for p, answers in enumerate(samples.answers):
            for g in range(0, len(answers) - n + 1, n):
                idx = select(answers[g:g + n], scores[key][p][g:g + n] if key else None)
                out[short].append((p, g, None if idx is None else g + idx))
    return out


def error_analysis(samples: Any, scores: dict[str, list[list[float]]],
                   steps: list[list[list[float]]], split: Any, n: int) -> dict[str, float]:
    """``err_<method>@<n>_{wrong,missed,avoidable}`` (module doc); ``split`` cuts a completion
    into the PRM's steps. ``missed`` is nan when no wrong pick has a wrong step."""
    out: dict[str, float] = {}
    for method, chosen in picks(samples, scores, n).items():
        wrong = missed = judged = avoidable = 0
        for p, g, idx in chosen:
            if idx is not None and samples.correct[p][idx]:
                continue
            wrong += 1
            avoidable += any(samples.correct[p][g:g + n])
            if idx is None:
                continue
            miss = first_wrong_step_missed(samples.prompts[p],
                                           split(samples.completions[p][idx]), steps[p][idx])
            if miss is not None:
                judged += 1
                missed += miss
        key = f"err_{method}@{n}"
        out.update({f"{key}_wrong": float(wrong),
                    f"{key}_missed": missed / judged if judged else float("nan"),
                    f"{key}_avoidable": avoidable / wrong if wrong else float("nan")})
    return out


def search_step_f1(samples: Any, steps: list[list[list[float]]], split: Any) -> float:
    """The PRM's bad-step F1 on the search samples themselves (exact labels)."""
    from posttrain.search.metrics import step_metrics
    from posttrain.tasks.step_labels import exact_labels

    scores, labels = [], []
    for p, row in enumerate(samples.completions):
        for i, c in enumerate(row):
            st = split(c)
            if st and len(steps[p][i]) == len(st):
                scores.append(steps[p][i])
                labels.append(exact_labels(samples.prompts[p], st))
    return step_metrics(scores, labels)["bad_f1"]


def analyse(samples: Any, orm: list[list[float]], prm: Any, bon_n: int) -> dict[str, float]:
    """Everything the verifiers job reports about search: accuracies at each N, the error
    analysis at N = 16 and 64 (those up to ``bon_n``) and the PRM's F1 on these samples."""
    steps = step_score_table(prm, samples)
    scores = selection_scores(orm, steps)
    ns = bon_ns(bon_n)
    out = bon_results(samples, scores, ns)
    for n in ANALYSED_N:
        if n in ns:
            out.update(error_analysis(samples, scores, steps, prm.split, n))
    out["prm_search_f1"] = search_step_f1(samples, steps, prm.split)
    return out


# ---------------------------------------------------------------------------------------------
# the rows of the table
# ---------------------------------------------------------------------------------------------
METHODS = (("majority", "majority vote"), ("orm", "ORM best-of-N"),
           ("prm_min", "PRM best-of-N, min"), ("prm_prod", "PRM best-of-N, product"),
           ("prm_last", "PRM best-of-N, last step"),
           ("weighted_prm_prod", "PRM-weighted vote (product)"), ("pass", "pass@N (oracle)"))
ANALYSED = (("orm", "ORM"), ("prm_prod", "PRM product"), ("prm_min", "PRM min"))


def verifier_metrics(s: dict[str, Any], m: Callable[..., dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    """The verifiers job's rows, made by ``m(job, claim, metric, key, scale)`` (claims.py)."""
    v, ns = "verifiers", bon_ns(s["bon_n"])
    rm = "ORM / PRM (rm_arith, prm_arith)"
    rows = [m(v, rm, "ORM held-out pair accuracy %", "orm_pair_accuracy", 100),
            m(v, rm, "PRM bad-step F1", "prm_bad_f1"),
            m(v, rm, "SFT sample accuracy on the labelled problems %", "label_accuracy", 100),
            m(v, rm, "PRM bad-step F1 on the best-of-N samples", "prm_search_f1")]
    bon = f"best-of-N, {s['bon_problems']} held-out problems x {s['bon_n']} samples"
    for n in ns:
        rows += [m(v, bon, f"{label} @{n} %", f"bon_{key}@{n}", 100) for key, label in METHODS]
        rows.append(m(v, bon, f"PRM product - ORM @{n} (points)",
                      lambda r, n=n: r[f"bon_prm_prod@{n}"] - r[f"bon_orm@{n}"], 100))
    why = f"wrong picks of best-of-N, {s['bon_problems']} held-out problems"
    for n in (n for n in ANALYSED_N if n in ns):
        for key, label in ANALYSED:
            rows += [m(v, why, f"{label} @{n}: first wrong step scored >= 0.5 by the PRM %",
                       f"err_{key}@{n}_missed", 100),
                     m(v, why, f"{label} @{n}: a correct sample was in the group %",
                       f"err_{key}@{n}_avoidable", 100)]
    budget = f"PRM training budget, {s['label_prompts']} problems x 4 samples"
    rows += [m(v, budget, f"PRM bad-step F1, {steps} steps, {n_rows or 'all'} label rows",
               f"prm_f1_{steps}x{n_rows}") for steps, n_rows in s.get("prm_budgets", [])]
    mc = f"Monte Carlo (K={s['shepherd_k']}) vs exact step labels, {s['shepherd_rows']} samples"
    return rows + [
        m(v, mc, "step label agreement %", "mc_agreement", 100),
        m(v, mc, "PRM bad-step F1, exact labels", "prm_exact_f1"),
        m(v, mc, "PRM bad-step F1, MC labels", "prm_mc_f1"),
        m(v, mc, "exact - MC F1", lambda r: r["prm_exact_f1"] - r["prm_mc_f1"])]


# ---------------------------------------------------------------------------------------------
# the job
# ---------------------------------------------------------------------------------------------
def verifiers_job(world: dict[str, str], s: dict[str, Any], out: Path, seed: int, train: Train,
                  tokens: int) -> dict[str, Any]:
    """Steps 1-5 of the module doc; ``train`` runs one trainer (``claims._train``), ``tokens``
    bounds every sample's new tokens."""
    from posttrain.models import load_model_and_tokenizer

    policy, tok = load_model_and_tokenizer(world["sft"])
    rows, files = label_files(policy, tok, s, out / "data", seed, tokens)
    orm = train("rm", "rm_arith.yaml", {
        "model": world["sft"], "train_data": str(files["pairs_train"]),
        "eval_data": str(files["pairs_heldout"]), "out_dir": str(out / "orm"), "seed": seed,
        "max_steps": s["rm_steps"], "eval_every": 0})
    prm = train_prm(train, world["sft"], files["exact_train"], files["exact_heldout"],
                    out / "prm", seed, s["prm_steps"])
    return {"orm_pair_accuracy": orm["eval_after"], "prm_bad_f1": prm["bad_f1"],
            "orm": str(out / "orm" / "final"), "prm": str(out / "prm" / "final"),
            "label_rows": len(rows),
            "label_accuracy": sum(r["correct"] for r in rows) / max(1, len(rows)),
            **best_of_n(policy, tok, out, s, seed, tokens),
            **prm_budgets(train, world["sft"], rows, files, s, out, seed, prm["bad_f1"]),
            **shepherd(train, world["sft"], policy, tok, rows, files, s, out, seed, tokens)}


def label_files(policy: Any, tok: Any, s: dict[str, Any], d: Path, seed: int, tokens: int
                ) -> tuple[list[dict[str, Any]], dict[str, Path]]:
    """Seed S's exact-label rows (4 samples per problem of the job's split) and the files of
    the ORM / PRM: exact rows and on-policy pairs, train and held-out."""
    from posttrain.tasks.arithmetic import write_jsonl
    from posttrain.tasks.preferences import offline_pairs
    from posttrain.tasks.step_labels import exact_rows, pair_rows

    kw = {"samples": 4, "max_new_tokens": tokens, "difficulty": s.get("split", "easy")}
    rows = exact_rows(policy, tok, s["label_prompts"], seed, **kw)
    held = exact_rows(policy, tok, s["label_heldout"], seed, split="heldout", **kw)
    files = {"exact_train": write_jsonl(rows, d / "exact_train.jsonl"),
             "exact_heldout": write_jsonl(held, d / "exact_heldout.jsonl"),
             "pairs_train": write_jsonl(pair_rows(rows, seed, 4) + offline_pairs(
                 s["offline_pairs"], seed, kind="mixed"), d / "pairs_train.jsonl"),
             "pairs_heldout": write_jsonl(pair_rows(held, seed, 1), d / "pairs_heldout.jsonl")}
    return rows, files


def train_prm(train: Train, sft: str, rows: Path, held: Path, out: Path, seed: int, steps: int
              ) -> dict[str, float]:
    """recipes/prm_arith.yaml from the SFT policy on ``rows``; its held-out step metrics."""
    run = train("prm", "prm_arith.yaml", {
        "model": sft, "train_data": str(rows), "eval_data": str(held),
        "out_dir": str(out), "seed": seed, "max_steps": steps, "eval_every": 0})
    return {"step_accuracy": run["eval_after"], "bad_f1": run["eval_after_detail"]["bad_f1"]}


def prm_budgets(train: Train, sft: str, rows: list[dict[str, Any]], files: dict[str, Path],
                s: dict[str, Any], out: Path, seed: int, main_f1: float) -> dict[str, float]:
    """``prm_f1_<steps>x<rows>``: the bad-step F1 (same held-out labels) of a PRM trained for
    ``steps`` steps on the first ``rows`` label rows (0: all of them), for each budget of
    ``prm_budgets``; the main PRM's budget (``prm_steps``, all rows) reuses its F1."""
    from posttrain.tasks.arithmetic import write_jsonl

    got: dict[str, float] = {}
    for steps, n_rows in s.get("prm_budgets", []):
        key = f"prm_f1_{steps}x{n_rows}"
        if steps == s["prm_steps"] and not n_rows:
            got[key] = main_f1
            continue
        data = (write_jsonl(rows[:n_rows], out / "data" / f"exact_first{n_rows}.jsonl")
                if n_rows else files["exact_train"])
        got[key] = train_prm(train, sft, data, files["exact_heldout"],
                             out / f"prm_{steps}x{n_rows}", seed, steps)["bad_f1"]
    return got


def shepherd(train: Train, sft: str, policy: Any, tok: Any, rows: list[dict[str, Any]],
             files: dict[str, Path], s: dict[str, Any], out: Path, seed: int, tokens: int
             ) -> dict[str, float]:
    """Monte Carlo (Math-Shepherd) labels of the first rows against their exact labels, and a
    PRM trained on each."""
    from posttrain.tasks.arithmetic import write_jsonl
    from posttrain.tasks.step_labels import label_agreement, math_shepherd_labels

    first = rows[:s["shepherd_rows"]]
    mc = math_shepherd_labels(policy, tok, first, s["shepherd_k"], seed=seed,
                              max_new_tokens=tokens)
    kept = iter(mc)  # math_shepherd_labels drops rows without steps: align the rest
    nxt = next(kept, None)
    aligned = []
    for r in first:
        if nxt is not None and (nxt["prompt"], nxt["completion"]) == (r["prompt"], r["completion"]):
            aligned.append(r)
            nxt = next(kept, None)
    agree = label_agreement(aligned, mc)
    d = out / "data"
    exact = train_prm(train, sft, write_jsonl(first, d / "exact_first.jsonl"),
                      files["exact_heldout"], out / "prm_exact_first", seed,
                      s["shepherd_prm_steps"])
    auto = train_prm(train, sft, write_jsonl(mc, d / "mc_first.jsonl"), files["exact_heldout"],
                     out / "prm_mc_first", seed, s["shepherd_prm_steps"])
    return {"mc_agreement": agree["step_agreement"],
            "mc_bad_rate": agree["bad_rate_auto"], "exact_bad_rate": agree["bad_rate_exact"],
            "prm_exact_f1": exact["bad_f1"], "prm_mc_f1": auto["bad_f1"],
            "prm_exact_acc": exact["step_accuracy"], "prm_mc_acc": auto["step_accuracy"]}


def best_of_n(policy: Any, tok: Any, out: Path, s: dict[str, Any], seed: int, tokens: int
              ) -> dict[str, float]:
    """``bon_n`` samples per held-out problem of seed S (the job's split), drawn once, scored
    by the ORM and the PRM: :func:`analyse`."""
    import torch

    from posttrain.search import sample_solutions, score_samples
    from posttrain.search.verifiers import load_orm_scorer, load_prm_scorer
    from posttrain.tasks.arithmetic import heldout_rows

    problems = heldout_rows(s["bon_problems"], seed, difficulty=s.get("split", "easy"))
    samples = sample_solutions(policy, tok, problems, s["bon_n"], max_new_tokens=tokens,
                               generator=torch.Generator().manual_seed(seed))
    orm = score_samples(samples, load_orm_scorer(out / "orm" / "final"))
    return analyse(samples, orm, load_prm_scorer(out / "prm" / "final"), s["bon_n"])
