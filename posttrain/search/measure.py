"""Measure search methods on held-out problems: accuracy and generated tokens for each.

1. :func:`sample_solutions` samples N completions per problem once (``posttrain.rollout
   .generate``), extracts answers, checks them against the gold answer and counts tokens.
2. Every outcome scorer scores every completion once.
3. :func:`evaluate_selection` evaluates each method at each n <= N on the N samples split into
   N/n disjoint groups of n (every group is one independent best-of-n trial), so one sample of
   N=64 gives 64 trials at n=1, 16 at n=4, ... and the accuracy at small n has little noise.

Methods: ``best_of_n:<scorer>`` (highest score), ``majority`` (most frequent answer),
``weighted:<scorer>`` (score-weighted vote), ``oracle`` (any of the n is correct: pass@n, the
ceiling of every selection method). Tokens: the mean over trials of the generated tokens of
the n completions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.rewards.errors import UnscorableError
from posttrain.rewards.math import math_equal
from posttrain.rollout.sampler import Sampler
from posttrain.search.scorers import OutcomeScorer
from posttrain.search.select import answers_of, best_of_n, majority_vote, weighted_vote


@dataclass
class Samples:
    """N sampled completions for each of P problems (lists are [P][N])."""

    prompts: list[Any]
    golds: list[str]
    completions: list[list[str]]
    tokens: list[list[int]]
    answers: list[list[str | None]]
    correct: list[list[bool]]


def is_correct(answer: str | None, gold: str) -> bool:
    """The extracted answer equals the gold answer (``math_equal``); no answer is wrong."""
    if answer is None:
        return False
    try:
        return math_equal(str(gold).strip(), answer)
    except UnscorableError as err:
        raise ValueError(f"gold answer {gold!r} cannot be checked: {err}") from err


def build_samples(prompts: list[Any], golds: list[str], completions: list[list[str]],
                  tokens: list[list[int]]) -> Samples:
    """Answers and correctness for given completions ([P][N] lists)."""
    answers = [answers_of(c) for c in completions]
    correct = [[is_correct(a, g) for a in row] for row, g in zip(answers, golds, strict=True)]
    return Samples(prompts, [str(g) for g in golds], completions, tokens, answers, correct)


def sample_solutions(model: torch.nn.Module | None, tokenizer: Any,
                     rows: Sequence[dict[str, Any]], n: int, *, max_new_tokens: int = 64,
                     temperature: float = 1.0, top_p: float = 1.0, batch_size: int = 512,
                     generator: torch.Generator | None = None, autocast: bool = False,
                     prompt_field: str = "prompt", answer_field: str = "answer",
                     template: str = "auto", sampler: Sampler | None = None) -> Samples:
    """Sample ``n`` completions per row (``{prompt, answer}``) with the policy; prompts are
    rendered under `template` (the `chat_template` rule, posttrain.data.prompts). `sampler`
    samples them (`posttrain.rollout.sampler`); None: the `hf` sampler on `model`."""
    from posttrain.data.prompts import render_prompt
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.sampler import HFSampler

    if sampler is None:
        sampler = HFSampler(tokenizer, autocast=autocast)
        sampler.update_weights(model, 0)
    prompts = [r[prompt_field] for r in rows]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    completions: list[list[str]] = []
    tokens: list[list[int]] = []
    per_call = max(1, batch_size // n)
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start:start + per_call]
        out = sampler.generate([render_prompt(tokenizer, p, template) for p in chunk],
                              group_size=n, params=params, generator=generator,
                              batch_size=batch_size)
        lengths = out.response_mask.sum(1).tolist()
        for j in range(len(chunk)):
            completions.append(out.completions[j * n:(j + 1) * n])
            tokens.append([int(x) for x in lengths[j * n:(j + 1) * n]])
    return build_samples(prompts, [r[answer_field] for r in rows], completions, tokens)


def score_samples(samples: Samples, scorer: OutcomeScorer, batch_size: int = 1024
                  ) -> list[list[float]]:
    """Every completion's score, [P][N], in batches of ``batch_size`` completions."""
    flat_p = [p for p, row in zip(samples.prompts, samples.completions, strict=True) for _ in row]
    flat_c = [c for row in samples.completions for c in row]
    flat_s: list[float] = []
    for start in range(0, len(flat_c), batch_size):
        got = scorer(flat_p[start:start + batch_size], flat_c[start:start + batch_size])
        if len(got) != len(flat_c[start:start + batch_size]):
            raise ValueError(f"scorer returned {len(got)} scores for "
                             f"{len(flat_c[start:start + batch_size])} completions")
        flat_s += [float(s) for s in got]
    out, i = [], 0
    for row in samples.completions:
        out.append(flat_s[i:i + len(row)])
        i += len(row)
    return out


Selector = Callable[[list[str | None], list[float] | None], int | None]


def selectors(scores: dict[str, list[list[float]]]) -> dict[str, tuple[Selector, str | None]]:
    """Method name -> (selector(answers, scores), name of the scores it reads)."""
    out: dict[str, tuple[Selector, str | None]] = {
        "majority": (lambda a, s: majority_vote(a), None),
    }
    for name in scores:
        out[f"best_of_n:{name}"] = (lambda a, s: best_of_n(s), name)
        out[f"weighted:{name}"] = (lambda a, s: weighted_vote(a, s), name)
    return out


def evaluate_selection(samples: Samples, n_values: Sequence[int],
                       scores: dict[str, list[list[float]]]) -> dict[str, dict[int, dict]]:
    """``{method: {n: {"accuracy", "tokens", "trials"}}}`` over disjoint groups of n samples.

    Includes ``oracle`` (pass@n). Each n must divide the number of samples per problem.
    """
    n_max = min(len(row) for row in samples.completions)
    bad = [n for n in n_values if n < 1 or n_max % n]
    if bad:
        raise ValueError(f"n values {bad} must be >= 1 and divide the {n_max} samples/problem")
    methods = selectors(scores)
    result: dict[str, dict[int, dict]] = {m: {} for m in [*methods, "oracle"]}
    for n in n_values:
        hits: dict[str, int] = dict.fromkeys(result, 0)
        trials, tokens = 0, 0
        for p in range(len(samples.prompts)):
            for g in range(n_max // n):
                sl = slice(g * n, (g + 1) * n)
                answers, correct = samples.answers[p][sl], samples.correct[p][sl]
                trials += 1
                tokens += sum(samples.tokens[p][sl])
                hits["oracle"] += any(correct)
                for name, (select, key) in methods.items():
                    idx = select(answers, scores[key][p][sl] if key else None)
                    hits[name] += idx is not None and correct[idx]
        for name in result:
            result[name][n] = {"accuracy": hits[name] / max(1, trials),
                               "tokens": tokens / max(1, trials), "trials": trials}
    return result
