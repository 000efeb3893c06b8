"""The reward-function contract: which call form a function uses, and what it needs.

Three call forms (docs/rewards.md):
- ``per_sample``: ``fn(completion, **fields) -> float``, once per sample, row fields by name.
- ``batched`` (TRL's form): ``fn(completions, prompts=None, **fields) -> list[float | None]``,
  once per batch, every needed row field as a list; a function is batched when a parameter is
  named ``completions`` or ``fn.batched = True``. ``None``: does not apply to this sample.
- ``rows``: ``fn(completions, rows, **kwargs) -> list[float]`` with ``fn.batched = True`` and a
  second parameter named ``rows`` (the learned rewards, which run a model).

A recipe entry's keys besides ``name``/``weight``/``kwargs`` become constant keyword arguments;
:func:`check_entry_keys` refuses one the function does not take, and :func:`needed_fields` lists
the row fields each function requires, checked before any model loads. Pure Python: no torch.
More: docs/rewards.md, "Module notes", posttrain.rewards.contract.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

PER_SAMPLE, BATCHED, ROWS = "per_sample", "batched", "rows"
ENTRY_KEYS = ("name", "weight", "kwargs")
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_BATCH_INPUTS = ("completions", "prompts")
EPISODE_FIELDS = ("messages", "environments", "environment_closed")
"""Fields a multi-turn rollout adds to each sample's row for the rewards (the episode's chat
messages, its environment instance, whether a call on it timed out): not required of the
dataset's rows."""


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def call_style(fn: Callable[..., Any]) -> str:
    """``per_sample``, ``batched`` (TRL) or ``rows`` (learned rewards); see the module doc."""
    params = _params(fn)
    names = [p.name for p in params]
    if getattr(fn, "batched", False) and len(names) > 1 and names[1] == "rows":
        return ROWS
    if getattr(fn, "batched", False) or "completions" in names:
        return BATCHED
    return PER_SAMPLE


def takes_any_keyword(fn: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _params(fn))


def field_params(fn: Callable[..., Any], style: str) -> list[inspect.Parameter]:
    """The named parameters a row field (or an entry key) can fill."""
    params = [p for p in _params(fn) if p.kind in _NAMED]
    if style == PER_SAMPLE:
        return params[1:]  # the first receives the completion
    if style == BATCHED:
        rest = [p for p in params if p.name not in _BATCH_INPUTS]
        return rest if "completions" in [p.name for p in params] else rest[1:]
    return params[2:]  # rows: completions, rows, then the entry's keyword arguments


_TRL_INPUTS = {"trainer_state": "TRL's TrainerState (global_step, epoch, ...)",
               "completion_ids": "TRL's completion token ids"}
"""Arguments TRL passes its reward functions that posttrain does not: a parameter named so,
without a default, is refused by name (not reported as a missing dataset column)."""


def check_entry_keys(name: str, fn: Callable[..., Any], keys: list[str]) -> None:
    """Refuse entry keys the function does not take, with a did-you-mean, and a required
    parameter only TRL passes (`_TRL_INPUTS`)."""
    style = call_style(fn)
    for p in field_params(fn, style):
        if p.name in _TRL_INPUTS and p.default is inspect.Parameter.empty and p.name not in keys:
            raise ValueError(f"reward {name!r}: its parameter '{p.name}' is "
                             f"{_TRL_INPUTS[p.name]}, which posttrain does not pass (a reward "
                             f"gets the completions and its rows' fields): give it a default "
                             f"({p.name}=None) or drop it")
    if takes_any_keyword(fn) or hasattr(fn, "validate_kwargs"):
        return  # **kwargs takes anything; learned rewards check their own keys
    valid = [p.name for p in field_params(fn, style)]
    for key in keys:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, [*ENTRY_KEYS, *valid], n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        takes = ", ".join(valid) or "no keyword arguments"
        raise ValueError(f"reward {name!r}: unknown key {key!r} in its entry.{hint} Entry keys: "
                         f"{', '.join(ENTRY_KEYS)}; {getattr(fn, '__name__', name)} takes: "
                         f"{takes}")


def needed_fields(fn: Callable[..., Any], constants: dict[str, Any]) -> list[str]:
    """Row fields the function requires (no default, not given by its recipe entry)."""
    style = call_style(fn)
    if style == ROWS:
        return []
    return [p.name for p in field_params(fn, style)
            if p.default is inspect.Parameter.empty and p.name not in constants
            and p.name not in EPISODE_FIELDS]


def batched_arguments(fn: Callable[..., Any], completions: list[str],
                      rows: list[dict[str, Any]], constants: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of one batched (TRL-form) call, besides ``completions``."""
    every = takes_any_keyword(fn)
    wanted = {p.name for p in field_params(fn, BATCHED)}
    names = {p.name for p in _params(fn)}
    kwargs: dict[str, Any] = {}
    if every or "prompts" in names:
        kwargs["prompts"] = [r.get("prompt") for r in rows]
    fields = {k for r in rows for k in r} - {"prompt"}
    for key in sorted(fields if every else fields & wanted):
        kwargs[key] = [r.get(key) for r in rows]
    kwargs.update(constants)
    return kwargs
