"""Step-labelled rows ``{"prompt", "steps", "labels"}`` for process reward models, two ways.

Completions are split into steps by the library's one step format (:mod:`posttrain.data.steps`:
``"think"``, the arithmetic task's ``<think>s1; s2; s3</think><answer>a</answer>``, or a literal
delimiter), the rule a PRM trained on these rows saves and scores with.

(a) **Exact labels** (:func:`exact_labels`, :func:`exact_rows`) for the policy's OWN samples on the
arithmetic task. Step ``i`` (``a op b = c``) is correct when its input ``a`` is the true value of
the problem prefix before it, ``op b`` is the problem's ``i``-th operation and ``c`` is the true
result; the answer step is correct when it equals the true answer. A step that does not parse,
or one past the problem's operations, is wrong. Convention after the first wrong step
(``after_first_error``):

* ``"negative"`` (default): every later step is -1 too. A step is good only when the whole prefix
  through it is right, which is what Math-Shepherd's automatic labels estimate (a prefix holding
  an error rarely reaches the answer), so (a) and (b) below are comparable.
* ``"truncate"``: the row ends at the first wrong step, as in PRM800K (Lightman et al. 2023,
  arXiv:2305.20050, whose labellers stop at the first mistake).

(b) **Automatic labels** (:func:`math_shepherd_rows`, Wang et al. 2023, "Math-Shepherd",
arXiv:2312.08935): from the prefix ending at each step, roll out ``K`` completions with the
policy and verify their final answers against the gold answer. Hard label: 1 when ANY rollout
reaches the answer, else -1; soft label: the FRACTION that do (kept in the extra field
``soft_labels``; ``labels`` always holds the hard ones). The final (answer) step needs no
rollout: its label is the completion's own correctness. This works on any dataset with a gold
answer, so it is the path real users take; it needs no step-level annotation.

Command line (writes ``exact_train.jsonl``, ``exact_heldout.jsonl`` and, with ``--shepherd K``,
``shepherd_train.jsonl`` under ``--out``)::

    python -m posttrain.tasks.step_labels --model runs/world/sft/final --out runs/steps
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.data.steps import split_steps, step_spans
from posttrain.tasks.arithmetic import (
    Problem,
    _apply,
    parse_problem,
    sample_problem,
    stream_key,
    write_jsonl,
)

AFTER_FIRST_ERROR = ("negative", "truncate")
_STEP_RE = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(\d+)\s*=\s*(-?\d+)\s*$")
_ANSWER_VALUE_RE = re.compile(r"^<answer>\s*(-?\d+)\s*</answer>$")


# ----------------------------------------------------------------------------------------------
# (a) exact labels on the arithmetic task
# ----------------------------------------------------------------------------------------------
def _step_ok(step: str, i: int, problem: Problem) -> bool:
    """Is ``step`` the correct ``i``-th step of ``problem`` (0-based)?"""
    n_ops = len(problem.ops)
    if i < n_ops:
        m = _STEP_RE.match(step)
        if m is None:
            return False
        a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        before = problem.operands[0] if i == 0 else problem.values[i - 1]
        return (a == before and op == problem.ops[i] and b == problem.operands[i + 1]
                and c == _apply(before, op, b))
    m = _ANSWER_VALUE_RE.match(step.strip())
    return i == n_ops and m is not None and int(m.group(1)) == problem.answer


def exact_labels(problem: Problem | str, steps: Sequence[str],
                 after_first_error: str = "negative") -> list[int]:
    """Exact labels (1 / -1) of ``steps`` (from :func:`split_steps`, answer step last).

    With ``after_first_error="truncate"`` the list stops at the first -1 (see the module doc).
    """
    if after_first_error not in AFTER_FIRST_ERROR:
        raise ValueError(f"after_first_error={after_first_error!r}; valid: "
                         f"{list(AFTER_FIRST_ERROR)}")
    problem = parse_problem(problem) if isinstance(problem, str) else problem
    labels: list[int] = []
    for i, step in enumerate(steps):
        ok = _step_ok(step, i, problem) and (not labels or labels[-1] == 1)
        labels.append(1 if ok else -1)
        if not ok and after_first_error == "truncate":
            break
    return labels


# ----------------------------------------------------------------------------------------------
# sampling the policy
# ----------------------------------------------------------------------------------------------
def sample_completions(model: Any, tokenizer: Any, prompts: list[str], samples: int, *,
                       seed: int = 0, temperature: float = 1.0, max_new_tokens: int = 64,
                       batch_size: int = 512) -> tuple[list[str], list[bool]]:
    """``samples`` completions per RENDERED prompt (group-contiguous) and truncation flags."""
    import torch

    from posttrain.rollout import SamplingParams
    from posttrain.rollout.sampler import model_sampler

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    rendered = list(prompts)
    texts: list[str] = []
    truncated: list[bool] = []
    chunk = max(1, batch_size // samples)
    sampler = model_sampler(model, tokenizer)
    for start in range(0, len(rendered), chunk):
        out = sampler.generate(rendered[start:start + chunk], group_size=samples,
                              params=params, generator=gen, batch_size=batch_size)
        texts += out.completions
        truncated += [bool(t) for t in out.truncated]
    return texts, truncated


def problems(n: int, seed: int, split: str, difficulty: str = "easy") -> list[Problem]:
    """``n`` distinct problems of ``split`` (a stream of its own: ``steplabels``) at
    ``difficulty`` (``posttrain.tasks.arithmetic.DIFFICULTIES``)."""
    rng = random.Random(stream_key(f"steplabels:{split}:{seed}", difficulty))
    out: list[Problem] = []
    seen: set[Problem] = set()
    while len(out) < n:
        p = sample_problem(rng, split=split, difficulty=difficulty)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def exact_rows(model: Any, tokenizer: Any, n_prompts: int, seed: int = 0, *,
               split: str = "train", samples: int = 4, after_first_error: str = "negative",
               temperature: float = 1.0, max_new_tokens: int = 64,
               difficulty: str = "easy") -> list[dict[str, Any]]:
    """(a): the policy's own samples with exact step labels, on problems of ``difficulty``.

    Rows ``{"prompt", "steps", "labels", "answer", "completion", "correct"}``; truncated samples
    are dropped (counted by the caller from ``n_prompts * samples - len(rows)``).
    """
    from posttrain.data.prompts import render_prompt
    from posttrain.rewards.math import math_reward

    probs = problems(n_prompts, seed, split, difficulty)
    prompts = [render_prompt(tokenizer, p.text) for p in probs]
    texts, truncated = sample_completions(model, tokenizer, prompts, samples,
                                          seed=seed, temperature=temperature,
                                          max_new_tokens=max_new_tokens)
    rows = []
    for j, (text, cut) in enumerate(zip(texts, truncated, strict=True)):
        problem = probs[j // samples]
        steps = split_steps(text)
        if cut or not steps:
            continue
        labels = exact_labels(problem, steps, after_first_error)
        rows.append({"prompt": problem.text, "steps": steps[:len(labels)], "labels": labels,
                     "answer": str(problem.answer), "completion": text,
                     "correct": math_reward(text, str(problem.answer)) >= 1.0})
    return rows


# ----------------------------------------------------------------------------------------------
# (b) Math-Shepherd automatic labels
# ----------------------------------------------------------------------------------------------
def math_shepherd_labels(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], k: int, *,
                         seed: int = 0, how: str = "think", temperature: float = 1.0,
                         max_new_tokens: int = 64, batch_size: int = 512
                         ) -> list[dict[str, Any]]:
    """(b): relabel each row's steps by rolling out ``k`` completions from every step prefix.

    Each row needs ``prompt``, ``completion`` (the sample whose steps are labelled) and
    ``answer`` (the gold answer). Returns copies with ``steps`` (split with ``how``),
    ``labels`` (hard: any rollout correct -> 1, else -1) and ``soft_labels`` (fraction correct).
    The final step is labelled by the completion's own correctness (no rollout).
    """
    from posttrain.data.prompts import render_prompt
    from posttrain.rewards.math import math_reward

    if k < 1:
        raise ValueError(f"math_shepherd_labels: k must be >= 1, got {k}")
    jobs: list[tuple[int, str]] = []  # (row index, completion prefix)
    spans_of = [step_spans(r["completion"], how) for r in rows]
    for i, (row, spans) in enumerate(zip(rows, spans_of, strict=True)):
        jobs += [(i, row["completion"][:end]) for _, end in spans[:-1]]
    prompts = [render_prompt(tokenizer, rows[i]["prompt"]) + prefix for i, prefix in jobs]
    conts, _ = sample_completions(model, tokenizer, prompts, k, seed=seed,
                                  temperature=temperature, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size)
    fractions: dict[int, list[float]] = {i: [] for i in range(len(rows))}
    for j, (i, prefix) in enumerate(jobs):
        answer = str(rows[i]["answer"])
        hits = sum(math_reward(prefix + c, answer) >= 1.0 for c in conts[j * k:(j + 1) * k])
        fractions[i].append(hits / k)
    out = []
    for i, (row, spans) in enumerate(zip(rows, spans_of, strict=True)):
        if not spans:
            continue
        final = float(math_reward(row["completion"], str(row["answer"])) >= 1.0)
        soft = [*fractions[i], final]
        out.append({**row, "steps": [row["completion"][a:b] for a, b in spans],
                    "labels": [1 if f > 0 else -1 for f in soft], "soft_labels": soft})
    return out


def outcome_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """ORM rows ``{"prompt", "completion", "label"}`` from labelled samples."""
    return [{"prompt": r["prompt"], "completion": r["completion"], "label": int(r["correct"]),
             "answer": r["answer"]} for r in rows]


def pair_rows(rows: Sequence[dict[str, Any]], seed: int = 0,
              per_prompt: int = 1) -> list[dict[str, Any]]:
    """ORM preference pairs: per prompt, up to ``per_prompt`` (correct, incorrect) pairs of
    distinct samples of the policy. Prompts whose samples are all correct or all incorrect give
    no pair."""
    rng = random.Random(f"pairs:{seed}")
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["prompt"], []).append(r)
    out = []
    for prompt, group in groups.items():
        good = sorted({r["completion"] for r in group if r["correct"]})
        bad = sorted({r["completion"] for r in group if not r["correct"]})
        combos = [(g, b) for g in good for b in bad]
        rng.shuffle(combos)
        out += [{"prompt": prompt, "chosen": g, "rejected": b, "answer": group[0]["answer"],
                 "source": "onpolicy"} for g, b in combos[:per_prompt]]
    return out


def label_agreement(exact: Sequence[dict[str, Any]], auto: Sequence[dict[str, Any]]
                    ) -> dict[str, float]:
    """How often automatic labels equal exact ones (rows aligned; "negative" convention)."""
    same = total = bad_exact = bad_auto = 0
    for a, b in zip(exact, auto, strict=True):
        for x, y in zip(a["labels"], b["labels"], strict=False):
            same += x == y
            total += 1
            bad_exact += x == -1
            bad_auto += y == -1
    return {"step_agreement": same / max(1, total), "bad_rate_exact": bad_exact / max(1, total),
            "bad_rate_auto": bad_auto / max(1, total), "steps": float(total)}


def main(argv: list[str] | None = None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the policy whose samples are labelled")
    ap.add_argument("--out", required=True, help="output folder for the JSONL files")
    ap.add_argument("--prompts", type=int, default=2000, help="train prompts")
    ap.add_argument("--heldout", type=int, default=300, help="held-out prompts")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--shepherd", type=int, default=0, help="K rollouts per step (0: skip (b))")
    ap.add_argument("--shepherd-rows", type=int, default=0,
                    help="label only the first N train samples with (b) (0: all); also writes "
                         "exact_train_first{N}.jsonl, the same samples with exact labels")
    ap.add_argument("--only-pairs", action="store_true",
                    help="reuse existing exact_*.jsonl instead of sampling again")
    ap.add_argument("--after-first-error", default="negative", choices=AFTER_FIRST_ERROR)
    ap.add_argument("--pairs-per-prompt", type=int, default=4,
                    help="on-policy ORM pairs per problem (correct x incorrect samples)")
    ap.add_argument("--offline-pairs", type=int, default=0,
                    help="also add this many off-policy pairs (reference trace vs injected "
                         "error, posttrain.tasks.preferences kind 'mixed') to pairs_train")
    ap.add_argument("--difficulty", default="easy", choices=["easy", "hard"],
                    help="the arithmetic problems' difficulty (posttrain.tasks.arithmetic)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    from posttrain.models import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, tok = load_model_and_tokenizer(args.model)
    out, written, kept = Path(args.out), {}, {}
    for split, n in (("train", args.prompts), ("heldout", args.heldout)):
        if args.only_pairs:
            path = out / f"exact_{split}.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            rows = exact_rows(model, tok, n, args.seed, split=split, samples=args.samples,
                              after_first_error=args.after_first_error,
                              difficulty=args.difficulty)
            written[f"exact_{split}"] = str(write_jsonl(rows, out / f"exact_{split}.jsonl"))
        pairs = pair_rows(rows, args.seed, args.pairs_per_prompt if split == "train" else 1)
        if split == "train" and args.offline_pairs:
            from posttrain.tasks.preferences import offline_pairs

            pairs += offline_pairs(args.offline_pairs, args.seed, kind="mixed")
        written[f"pairs_{split}"] = str(write_jsonl(pairs, out / f"pairs_{split}.jsonl"))
        written[f"outcomes_{split}"] = str(write_jsonl(outcome_rows(rows),
                                                       out / f"outcomes_{split}.jsonl"))
        bad = sum(v == -1 for r in rows for v in r["labels"])
        steps = sum(len(r["labels"]) for r in rows)
        print(f"{split}: {len(rows)} rows, sample accuracy "
              f"{sum(r['correct'] for r in rows) / max(1, len(rows)):.3f}, "
              f"bad steps {bad}/{steps}")
        kept[split] = rows
    if args.shepherd:
        rows, name = kept["train"], "shepherd_train.jsonl"
        if args.shepherd_rows:
            n = args.shepherd_rows
            rows, name = rows[:n], f"shepherd_train_first{n}.jsonl"
            written["exact_subset"] = str(write_jsonl(
                rows, out / f"exact_train_first{n}.jsonl"))
        auto = math_shepherd_labels(model, tok, rows, args.shepherd, seed=args.seed + 1)
        written["shepherd_train"] = str(write_jsonl(auto, out / name))
        print("math-shepherd vs exact:", label_agreement(rows, auto))
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    return written


if __name__ == "__main__":
    main()
