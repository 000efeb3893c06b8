"""vLLM's outputs as a `Rollout`: pure functions, no vLLM import (tested with fake objects).

A vLLM completion (``CompletionOutput``, or one choice of the HTTP server's answer) carries
``token_ids``, ``logprobs`` (one entry per generated token: a mapping token id -> an object
with ``.logprob`` or a float, or the float itself) and ``finish_reason`` ("stop" or
"length"). The samplers send one request per sequence (n=1, a seed each), in group-contiguous
order, so sequence i*G + j is sample j of prompt i.

Notation: B prompts, G samples per prompt, N = B*G sequences, T the longest completion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.rollout.record import Rollout

__all__ = ["Completion", "completion_of", "cut_at_stop", "sampled_logprob", "to_rollout"]


@dataclass
class Completion:
    """One sequence as the samplers hand it over: its tokens, their log-probs, why it ended."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None


def sampled_logprob(entry: Any, token: int) -> float:
    """The log-prob of `token` from one position's logprobs entry: a float, an object with
    ``.logprob``, or a mapping token id -> either of those (vLLM's ``{id: Logprob}``)."""
    if isinstance(entry, Mapping):
        if token not in entry:
            raise ValueError(f"vLLM logprobs: the sampled token {token} is not in this "
                             f"position's entries {sorted(entry)[:8]}")
        entry = entry[token]
    value = getattr(entry, "logprob", entry)
    return float(value)


def completion_of(output: Any) -> Completion:
    """A `Completion` from a vLLM ``RequestOutput`` (its first ``outputs[0]``), a
    ``CompletionOutput``, or anything with ``token_ids`` / ``logprobs`` / ``finish_reason``."""
    if hasattr(output, "outputs"):  # RequestOutput with n=1
        if len(output.outputs) != 1:
            raise ValueError(f"expected one completion per request (n=1), got "
                             f"{len(output.outputs)}")
        output = output.outputs[0]
    tokens = [int(t) for t in output.token_ids]
    raw = getattr(output, "logprobs", None)
    logprobs = None
    if raw is not None:
        if len(raw) != len(tokens):
            raise ValueError(f"vLLM output: {len(raw)} logprob entries for {len(tokens)} "
                             "tokens")
        logprobs = [sampled_logprob(e, t) for e, t in zip(raw, tokens, strict=True)]
    return Completion(tokens, logprobs, getattr(output, "finish_reason", None))


def cut_at_stop(c: Completion, stops: set[int], i: int
                ) -> tuple[list[int], list[float], bool]:
    """(tokens through the first stop id, their log-probs (0 without), truncated: no stop
    id) of sequence `i`."""
    logprobs = c.logprobs if c.logprobs is not None else [0.0] * len(c.token_ids)
    for k, tok in enumerate(c.token_ids):
        if tok in stops:
            return c.token_ids[:k + 1], logprobs[:k + 1], False
    if c.finish_reason == "stop":
        raise ValueError(f"sequence {i}: vLLM reports finish_reason=stop but no stop id "
                         f"{sorted(stops)} is among its tokens (was the stop token dropped, or "
                         "a stop string used?)")
    if c.finish_reason not in ("length", None):
        raise ValueError(f"sequence {i}: finish_reason={c.finish_reason!r} (aborted?)")
    return c.token_ids, logprobs, True


def to_rollout(outputs: Sequence[Any], *, prompts: list[list[int]], group_size: int,
               stop_ids: Sequence[int], pad_token_id: int, tokenizer: Any = None,
               rows: list[dict[str, Any]] | None = None) -> Rollout:
    """A group-contiguous `Rollout` from N vLLM outputs (in request order).

    Args:
        outputs: N ``RequestOutput`` / ``CompletionOutput`` / `Completion` objects.
        prompts: the N prompt id lists sent (sample j of prompt i at i * group_size + j).
        stop_ids: every id that ends a completion (EOS, a chat turn's end...).
        rows: the B = N / group_size prompts' rows.
    Returns `Rollout.from_sequences`' record: `response_mask` through the first stop id (the
    stop token counts), `truncated` where no stop id was sampled.
    """
    if len(outputs) != len(prompts):
        raise ValueError(f"{len(outputs)} vLLM outputs for {len(prompts) // group_size} "
                         f"prompts x {group_size} samples")
    stops = {int(s) for s in stop_ids}
    cut = [cut_at_stop(o if isinstance(o, Completion) else completion_of(o), stops, i)
           for i, o in enumerate(outputs)]
    B = len(prompts) // group_size
    return Rollout.from_sequences(
        prompts, [t for t, _, _ in cut], [lp for _, lp, _ in cut], [t for _, _, t in cut],
        group_size=group_size, pad_token_id=pad_token_id, tokenizer=tokenizer,
        rows=[r for r in (rows or [{}] * B) for _ in range(group_size)])
