"""Held-out evaluation: batched greedy (or sampled) decoding scored by a reward function.

Prompts are rendered with the chat template, LEFT padded and decoded with ``model.generate``.
The default scorer is a local exact comparison of the integer inside ``<answer>...</answer>``
(the arithmetic task's answers are integers); pass ``reward_fn`` (``(completion, answer) ->
float``, e.g. ``posttrain.rewards.math_reward``) for anything else. A score of ``None`` or NaN
marks the sample unscorable: it is excluded from the accuracy and counted.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from posttrain.data.prompts import render_prompt

RewardFn = Callable[[str, str], float | None]
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` block, stripped; None when absent."""
    found = _ANSWER_RE.findall(completion)
    return found[-1].strip() if found else None


def exact_int_reward(completion: str, answer: str) -> float:
    """1.0 when the ``<answer>`` content is the same integer as ``answer``, else 0.0."""
    pred = extract_answer(completion)
    try:
        return float(pred is not None and int(pred) == int(str(answer).strip()))
    except ValueError:
        return 0.0


def has_format(completion: str) -> bool:
    """``<think>...</think>`` followed by ``<answer>...</answer>`` and nothing else."""
    return bool(_FORMAT_RE.match(completion))


@torch.no_grad()
def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: list,
    *,
    batch_size: int = 128,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    seed: int = 0,
) -> tuple[list[str], list[bool]]:
    """Decode each prompt (greedy when ``temperature`` is None, else sampled).

    Returns the completion texts (special tokens removed) and whether each one was cut at
    ``max_new_tokens`` without reaching EOS.
    """
    texts = [render_prompt(tokenizer, p) for p in prompts]
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    sampling = {"do_sample": False} if temperature is None else {
        "do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    was_training = model.training
    model.eval()
    completions: list[str] = []
    truncated: list[bool] = []
    try:
        with torch.random.fork_rng(devices=[]):  # sampling must not move the global RNG
            torch.manual_seed(seed)
            for start in range(0, len(texts), batch_size):
                enc = tokenizer(texts[start : start + batch_size], return_tensors="pt",
                                padding=True, add_special_tokens=False)
                out = model.generate(**enc, max_new_tokens=max_new_tokens,
                                     pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, **sampling)
                new = out[:, enc["input_ids"].shape[1] :]  # [b, T]
                for row in new:
                    ended = bool((row == tokenizer.eos_token_id).any())
                    truncated.append(not ended)
                    completions.append(tokenizer.decode(row, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return completions, truncated


def score_completions(
    completions: list[str], answers: list[str], reward_fn: RewardFn | None = None
) -> list[float | None]:
    """Scores in [0, 1] per completion; None where the scorer could not score."""
    fn = reward_fn or exact_int_reward
    scores: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        score = fn(completion, answer)
        scores.append(None if score is None or math.isnan(float(score)) else float(score))
    return scores


def _accuracy(
    model: Any, tokenizer: Any, rows: list[dict], *, batch_size: int, max_new_tokens: int,
    reward_fn: RewardFn | None, temperature: float | None, seed: int, keep: int,
    return_completions: bool,
) -> dict[str, Any]:
    start = time.perf_counter()
    completions, truncated = generate_completions(
        model, tokenizer, [r["prompt"] for r in rows], batch_size=batch_size,
        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    scores = score_completions(completions, [str(r["answer"]) for r in rows], reward_fn)
    scored = [s for s in scores if s is not None]
    n = len(rows)
    result: dict[str, Any] = {
        "accuracy": sum(scored) / len(scored) if scored else 0.0,
        "format_rate": sum(has_format(c) for c in completions) / max(1, n),
        "truncated_rate": sum(truncated) / max(1, n),
        "n": n,
        "unscorable": n - len(scored),
        "seconds": time.perf_counter() - start,
        "samples": [{"prompt": r["prompt"], "completion": c, "answer": str(r["answer"]),
                     "score": s} for r, c, s in zip(rows[:keep], completions[:keep], scores[:keep],
                                                  strict=True)],
    }
    if return_completions:
        result["completions"], result["scores"] = completions, scores
    return result


def greedy_accuracy(
    model: Any, tokenizer: Any, rows: list[dict], *, batch_size: int = 128,
    max_new_tokens: int = 64, reward_fn: RewardFn | None = None, keep_samples: int = 8,
    return_completions: bool = False,
) -> dict[str, Any]:
    """Greedy held-out accuracy over ``rows`` (``{"prompt", "answer"}``).

    Returns ``{"accuracy", "format_rate", "truncated_rate", "n", "unscorable", "seconds",
    "samples"}`` (+ ``"completions"``, ``"scores"`` when ``return_completions``).
    """
    return _accuracy(model, tokenizer, rows, batch_size=batch_size,
                     max_new_tokens=max_new_tokens, reward_fn=reward_fn, temperature=None,
                     seed=0, keep=keep_samples, return_completions=return_completions)


def sample_accuracy(
    model: Any, tokenizer: Any, rows: list[dict], *, temperature: float = 1.0,
    batch_size: int = 128, max_new_tokens: int = 64, reward_fn: RewardFn | None = None,
    seed: int = 0, keep_samples: int = 8, return_completions: bool = False,
) -> dict[str, Any]:
    """Like :func:`greedy_accuracy` with one sample per prompt at ``temperature``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    return _accuracy(model, tokenizer, rows, batch_size=batch_size,
                     max_new_tokens=max_new_tokens, reward_fn=reward_fn,
                     temperature=temperature, seed=seed, keep=keep_samples,
                     return_completions=return_completions)
