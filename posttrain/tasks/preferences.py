"""Preference pairs ``{"prompt", "chosen", "rejected"}`` from the arithmetic task, for DPO.

Two sources, so off-policy and on-policy preference data can be compared on the same task:

* :func:`offline_pairs` (off-policy, no model needed): ``chosen`` is the exact reference trace;
  ``rejected`` is an error-injected trace of the same problem. ``kind`` picks the error:
  ``"flaw"`` the systematic sign-dropping flaw (only problems where it changes the answer, i.e.
  with a negative intermediate result), ``"error"`` random wrong step results (any problem),
  ``"mixed"`` the flaw where it applies and a random error elsewhere, ``"sign"`` the flaw where
  it applies and elsewhere a SPURIOUS minus sign (one positive intermediate result written
  negated, the chain continuing from it). ``"sign"`` teaches the sign in both directions: with
  ``"flaw"`` pairs alone, DPO learns "more minus signs is better" and greedy decoding collapses
  into writing minus signs everywhere (measured in docs/dpo.md).
* :func:`onpolicy_pairs`: ``G`` samples per prompt from a model (usually the SFT start), scored
  with the verifiable math reward; ``chosen`` is a correct sample and ``rejected`` an incorrect
  one for the same prompt. Prompts whose samples are all correct or all incorrect give no pair
  (how many is reported), truncated samples are never used.

Every pair is checked: the chosen completion's answer is correct, the rejected one's is not.
Rows carry two extra fields, ``answer`` and ``source`` (``offline:<kind>`` or ``onpolicy``),
which the data loader passes through. Held-out pairs come from the held-out problem split
(``split="heldout"``), which training generators never emit.

:func:`unpaired_rows` turns pairs into KTO's unpaired rows ``{"prompt", "completion", "label"}``:
the chosen completion labelled true and the rejected one false, in a seeded random order.

Command line (writes ``pref_train.jsonl``, ``pref_heldout.jsonl`` and KTO's ``kto_train.jsonl``
(the training pairs, unpaired) under ``--out``; with ``--model`` also ``pref_onpolicy.jsonl``
and ``pref_onpolicy_heldout.jsonl``)::

    python -m posttrain.tasks.preferences --out runs/demo/data --model runs/demo/sft/final
"""

from __future__ import annotations

import argparse
import operator
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.tasks.arithmetic import (
    Problem,
    format_trace,
    render_trace,
    sample_problem,
    trace_steps,
    write_jsonl,
)

_MAX_TRIES = 1000


def _answer_of(completion: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, or None."""
    start = completion.rfind("<answer>")
    end = completion.find("</answer>", start)
    if start == -1 or end == -1:
        return None
    return completion[start + len("<answer>") : end].strip()


def _flaw_trace(problem: Problem, rng: random.Random) -> str | None:
    """The sign-dropping trace, or None when it gives the right answer (no negative value)."""
    steps, _, final = trace_steps(problem, rng, flaw_rate=1.0)
    return format_trace(steps, final) if final != problem.answer else None


def _error_trace(problem: Problem, rng: random.Random) -> str:
    """A trace with at least one wrong step result and a wrong final answer."""
    for _ in range(_MAX_TRIES):
        steps, _, final = trace_steps(problem, rng, error_rate=0.5)
        if final != problem.answer:
            return format_trace(steps, final)
    raise RuntimeError(f"could not inject an error into {problem.text}")  # pragma: no cover


def _mixed_trace(problem: Problem, rng: random.Random) -> str:
    return _flaw_trace(problem, rng) or _error_trace(problem, rng)


_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _spurious_sign_trace(problem: Problem, rng: random.Random) -> str | None:
    """One positive intermediate result written with a minus sign; None if none is positive."""
    positive = [i for i, v in enumerate(problem.values) if v > 0]
    if not positive:
        return None
    k = rng.choice(positive)
    value, steps = problem.operands[0], []
    for i, (op, b) in enumerate(zip(problem.ops, problem.operands[1:], strict=True)):
        result = _APPLY[op](value, b)
        result = -result if i == k else result
        steps.append(f"{value}{op}{b}={result}")
        value = result
    return format_trace(steps, value)  # the negated offset propagates: never the right answer


def _sign_trace(problem: Problem, rng: random.Random) -> str | None:
    return _flaw_trace(problem, rng) or _spurious_sign_trace(problem, rng)


REJECTED_KINDS: dict[str, Callable[[Problem, random.Random], str | None]] = {
    "flaw": _flaw_trace,
    "error": _error_trace,
    "mixed": _mixed_trace,
    "sign": _sign_trace,
}


def _distinct_problems(rng: random.Random, split: str) -> Any:
    """Endless stream of distinct problems from ``split``."""
    seen: set[Problem] = set()
    while True:
        problem = sample_problem(rng, split=split)
        if problem not in seen:
            seen.add(problem)
            yield problem


def offline_pairs(n: int, seed: int = 0, *, kind: str = "mixed",
                  split: str = "train") -> list[dict[str, Any]]:
    """``n`` off-policy pairs on distinct problems: reference trace vs error-injected trace.

    ``kind``: ``"flaw"`` | ``"error"`` | ``"mixed"`` | ``"sign"`` (see the module docstring).
    """
    if kind not in REJECTED_KINDS:
        raise ValueError(f"unknown rejected kind {kind!r}; valid: {sorted(REJECTED_KINDS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"pref:{split}:{kind}:{seed}")
    rows: list[dict[str, Any]] = []
    problems = _distinct_problems(rng, split)
    while len(rows) < n:
        problem = next(problems)
        rejected = REJECTED_KINDS[kind](problem, rng)
        if rejected is None:  # the chosen kind of error does not apply to this problem
            continue
        chosen, _ = render_trace(problem, rng)
        rows.append({"prompt": problem.text, "chosen": chosen, "rejected": rejected,
                     "answer": str(problem.answer), "source": f"offline:{kind}"})
    return rows


def unpaired_rows(pairs: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """KTO's unpaired rows from pairs: chosen -> label true, rejected -> label false (extra
    fields kept), shuffled with ``seed`` so the two halves of a pair are not neighbours."""
    rows = [{**{k: v for k, v in pair.items() if k not in ("chosen", "rejected")},
             "completion": pair[side], "label": side == "chosen"}
            for pair in pairs for side in ("chosen", "rejected")]
    random.Random(f"unpaired:{seed}").shuffle(rows)
    return rows


def onpolicy_pairs(
    model: Any,
    tokenizer: Any,
    n_prompts: int,
    seed: int = 0,
    *,
    split: str = "train",
    samples: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 64,
    batch_size: int = 512,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Pairs from ``model``'s own samples: a correct vs an incorrect completion per prompt.

    Samples ``samples`` completions for each of ``n_prompts`` distinct problems and scores them
    with :func:`posttrain.rewards.math.math_reward`. Returns the pairs and statistics
    (``prompts``, ``pairs``, ``sample_accuracy``, ``all_correct``, ``all_wrong``).
    """
    import torch

    from posttrain.data.prompts import render_prompt
    from posttrain.rewards.math import math_reward
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.sampler import model_sampler

    if samples < 2:
        raise ValueError(f"on-policy pairs need samples >= 2 per prompt, got {samples}")
    rng = random.Random(f"onpolicy:{split}:{seed}")
    problems = _distinct_problems(rng, split)
    chosen_problems = [next(problems) for _ in range(n_prompts)]
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    rows: list[dict[str, Any]] = []
    stats = {"prompts": float(n_prompts), "all_correct": 0.0, "all_wrong": 0.0, "correct": 0.0}
    chunk = max(1, batch_size // samples)
    sampler = model_sampler(model, tokenizer)
    for start in range(0, n_prompts, chunk):
        part = chosen_problems[start : start + chunk]
        prompts = [render_prompt(tokenizer, p.text) for p in part]
        rollout = sampler.generate(prompts, group_size=samples, params=params, generator=gen,
                                  batch_size=batch_size)
        for i, problem in enumerate(part):
            group = range(i * samples, (i + 1) * samples)
            answer = str(problem.answer)
            good, bad = [], []
            for j in group:
                if bool(rollout.truncated[j]):
                    continue
                text = rollout.completions[j]
                (good if math_reward(text, answer) >= 1.0 else bad).append(text)
            stats["correct"] += len(good)
            if not good or not bad:
                stats["all_wrong" if not good else "all_correct"] += 1
                continue
            rows.append({"prompt": problem.text, "chosen": rng.choice(good),
                         "rejected": rng.choice(bad), "answer": answer, "source": "onpolicy"})
    stats["sample_accuracy"] = stats.pop("correct") / max(1, n_prompts * samples)
    stats["pairs"] = float(len(rows))
    return rows, stats


def check_pairs(rows: list[dict[str, Any]]) -> None:
    """Raise ValueError unless every chosen answer is correct and every rejected one is not."""
    for i, row in enumerate(rows):
        if _answer_of(row["chosen"]) != row["answer"]:
            raise ValueError(f"pair {i}: chosen answer {_answer_of(row['chosen'])!r} != "
                             f"{row['answer']!r}")
        if _answer_of(row["rejected"]) == row["answer"]:
            raise ValueError(f"pair {i}: rejected answer equals the correct {row['answer']!r}")


def main(argv: list[str] | None = None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder for the JSONL files")
    ap.add_argument("--n", type=int, default=4000, help="training pairs (offline)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out pairs")
    ap.add_argument("--kind", default="sign", choices=sorted(REJECTED_KINDS),
                    help="error injected into the offline rejected traces")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="", help="also write on-policy pairs sampled from it")
    ap.add_argument("--prompts", type=int, default=2000, help="on-policy prompts sampled")
    ap.add_argument("--samples", type=int, default=8, help="on-policy samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    train = offline_pairs(args.n, args.seed, kind=args.kind)
    written = {
        "train": str(write_jsonl(train, out / "pref_train.jsonl")),
        "kto_train": str(write_jsonl(unpaired_rows(train, args.seed), out / "kto_train.jsonl")),
        "heldout": str(write_jsonl(offline_pairs(args.heldout, args.seed, kind=args.kind,
                                                 split="heldout"), out / "pref_heldout.jsonl")),
    }
    if args.model:
        from posttrain.models import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(args.model)
        for split, n, name in (("train", args.prompts, "pref_onpolicy.jsonl"),
                               ("heldout", max(1, args.heldout), "pref_onpolicy_heldout.jsonl")):
            rows, stats = onpolicy_pairs(model, tok, n, args.seed, split=split,
                                         samples=args.samples, temperature=args.temperature)
            written[f"onpolicy_{split}"] = str(write_jsonl(rows, out / name))
            print(f"on-policy {split}: " + " ".join(f"{k}={v:.3f}" for k, v in stats.items()))
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    return written


if __name__ == "__main__":
    main()
