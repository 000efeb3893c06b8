"""Named reward functions and `Rewards`: their weighted sum, which counts every failure.

Call forms: :mod:`posttrain.rewards.contract`, docs/rewards.md. Built-in names: ``math``,
``format``, ``code``, learned, ``environment``, ``remote``, ``judge``; else ``"pkg.mod:fn"``.
Entry keys other than ``name``/``weight``/``kwargs`` become keyword arguments (unknown ones
refused); row fields go by parameter name (``RewardSpec.kwargs`` win over a row's field).
``Rewards.score``: the weighted sum per sample over the functions that score it (``None``:
not scored; no function scores it: 0, counted in ``reward/unscored``; :class:`UnscorableError`:
``nan``, excluded and counted), per-function values, metrics and error records. Other errors and
NaN / infinite values are counted and recorded; ``on_error``: ``auto`` raises
:class:`RewardFunctionError` when one function fails on more than half a batch, ``zero`` never,
``raise`` at the first failure; :class:`SandboxUnavailableError` always raises.
More: docs/rewards.md, "Module notes", posttrain.rewards.registry.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from posttrain.rewards.code import code_reward, code_reward_detailed
from posttrain.rewards.contract import (
    PER_SAMPLE,
    ROWS,
    batched_arguments,
    call_style,
    check_entry_keys,
    needed_fields,
)
from posttrain.rewards.errors import RewardFunctionError, UnscorableError
from posttrain.rewards.format import format_reward
from posttrain.rewards.judge import judge_reward
from posttrain.rewards.learned import process_reward_model_reward, reward_model_reward
from posttrain.rewards.math import math_reward
from posttrain.rewards.remote import remote_reward
from posttrain.sandbox.jail import STATUSES, SandboxUnavailableError

RewardFn = Callable[..., float]


async def environment_scores(completions: list[str], environments: list[Any],
                             environment_closed: list[bool] | None = None
                             ) -> list[float | None]:
    """The environment's own score of each episode (`get_reward()`; docs/agents.md): None
    (not scored) for a sample without an environment or whose environment has no get_reward.
    The `async def get_reward` ones are awaited together.

    A closed episode (a call on its environment timed out: `environment_closed`) scores the
    lowest score of the batch's finished episodes (a batch holds whole groups), so timing a
    call out on purpose never beats finishing wrong; None when no episode of the batch
    finished with a score."""
    closed = environment_closed or [False] * len(environments)
    values = [env.get_reward() if hasattr(env, "get_reward") and not shut else None
              for env, shut in zip(environments, closed, strict=True)]
    scores = list(await asyncio.gather(*(_settled(v) for v in values)))
    lowest = min((s for s in map(_finite, scores) if s is not None), default=None)
    return [lowest if shut else score for score, shut in zip(scores, closed, strict=True)]


async def _settled(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number: its own sample's error, later)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def environment_reward(completions: list[str], environments: list[Any],
                       environment_closed: list[bool] | None = None) -> list[float | None]:
    """:func:`environment_scores` for a synchronous caller (on the run's event loop)."""
    from posttrain.rollout.tools import resolve

    return resolve(environment_scores(completions, environments, environment_closed))


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "format": format_reward,
    "code": code_reward,
    "reward_model": reward_model_reward,
    "process_reward_model": process_reward_model_reward,
    "environment": environment_scores,
    "remote": remote_reward,
    "judge": judge_reward,
}
# Functions whose detailed variant also reports an outcome status for the counters.
_DETAILED: dict[Any, Callable[..., tuple[float, Any]]] = {code_reward: code_reward_detailed}
_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_ON_ERROR = {"auto": "auto", "zero": "zero", "raise": "raise"}
_EXCERPT_CHARS = 200


@dataclass(frozen=True)
class RewardSpec:
    """One named reward function and its weight in the sum."""

    name: str
    """Built-in name (``math``, ``format``, ``code``) or ``"package.module:function"``."""
    weight: float = 1.0
    """Multiplier in the weighted sum."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for every call (e.g. ``{"partial": True}`` for ``code``)."""
    fn: RewardFn | None = field(default=None, compare=False)
    """The callable itself (Python API); None: resolved from ``name``."""

    @classmethod
    def from_dict(cls, entry: dict[str, Any], fn: RewardFn | None = None) -> RewardSpec:
        """A recipe entry: ``name``, ``weight``, ``kwargs`` and any other key (``path: DIR``)
        as a keyword argument, so ``{name: reward_model, path: DIR}`` works."""
        extra = {k: v for k, v in entry.items() if k not in ("name", "weight", "kwargs")}
        if "name" not in entry:
            raise TypeError(f"reward entry {entry!r} has no 'name'")
        return cls(entry["name"], entry.get("weight", 1.0),
                   {**(entry.get("kwargs") or {}), **extra}, fn)



@dataclass
class ScoreResult:
    """Scores of one batch. ``scores[i]`` is ``nan`` for an unscorable sample."""

    scores: list[float]
    per_function: dict[str, list[float]]
    metrics: dict[str, float]
    errors: list[dict[str, Any]]


def resolve_reward(name: str) -> RewardFn:
    """The function for a built-in name or a ``"package.module:function"`` target."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if ":" not in name:
        if name not in BUILTIN_REWARDS:
            raise ValueError(f"unknown reward {name!r}; built-in rewards: "
                             f"{sorted(BUILTIN_REWARDS)} (or 'package.module:function')")
        return BUILTIN_REWARDS[name]
    if not _TARGET_RE.match(name):
        raise ValueError(f"reward {name!r}: expected 'package.module:function'")
    module_name, function_name = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {name!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, function_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward {name!r}: module {module_name!r} has no callable "
                         f"{function_name!r}")
    return fn


def validate_specs(specs: Sequence[RewardSpec | str]) -> list[tuple[RewardSpec, RewardFn]]:
    """Check every spec (name, weight, unique names, importable function) before any work."""
    if not specs:
        raise ValueError("no reward functions given: need at least one RewardSpec")
    resolved: list[tuple[RewardSpec, RewardFn]] = []
    seen: set[str] = set()
    for index, spec in enumerate(specs):
        spec = RewardSpec(spec) if isinstance(spec, str) else spec
        if not isinstance(spec, RewardSpec):
            raise ValueError(f"reward spec {index}: expected RewardSpec or str, got {spec!r}")
        if isinstance(spec.weight, bool) or not isinstance(spec.weight, (int, float)) \
                or not math.isfinite(spec.weight):
            raise ValueError(f"reward spec {index} ({spec.name!r}): weight must be a finite "
                             f"number, got {spec.weight!r}")
        if spec.name in seen:
            raise ValueError(f"reward spec {index}: {spec.name!r} is listed twice")
        seen.add(spec.name)
        fn = spec.fn if spec.fn is not None else resolve_reward(spec.name)
        try:
            inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward {spec.name!r}: cannot read its signature: {exc}") from exc
        if hasattr(fn, "validate_kwargs"):  # learned rewards: check `path` before any model loads
            fn.validate_kwargs(spec.kwargs)
        check_entry_keys(spec.name, fn, list(spec.kwargs))
        resolved.append((spec, fn))
    return resolved


def call_arguments(fn: RewardFn, spec: RewardSpec, row: dict[str, Any], index: int
                   ) -> dict[str, Any]:
    """Keyword arguments for ``fn(completion, **kwargs)`` taken from the row by parameter name."""
    params = list(inspect.signature(fn).parameters.values())[1:]  # the first is the completion
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        kwargs = dict(row)
    else:
        names = {p.name for p in params
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               inspect.Parameter.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in row.items() if k in names}
    kwargs.update(spec.kwargs)
    missing = [p.name for p in params if p.default is inspect.Parameter.empty
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              inspect.Parameter.KEYWORD_ONLY) and p.name not in kwargs]
    if missing:
        raise ValueError(f"reward {spec.name!r}: sample {index} has no field(s) {missing}; "
                         f"the row has {sorted(row)}")
    return kwargs


class Rewards:
    """Weighted sum of named reward functions over a batch, run on a thread pool."""

    def __init__(self, specs: Sequence[RewardSpec | str], on_error: str = "auto",
                 max_workers: int | None = None, timeout_s: float = 60.0) -> None:
        if on_error not in _ON_ERROR:
            raise ValueError(f"unknown on_error {on_error!r}; valid values: {sorted(_ON_ERROR)}")
        self.resolved = validate_specs(specs)
        self.on_error = on_error
        self.timeout_s = timeout_s
        """Bound on each awaited call (an `async def` reward or get_reward); past it the call
        is cancelled and its samples are reward errors. Threads cannot be stopped: a
        synchronous function is not bounded by it."""
        self.max_workers = max(1, max_workers or os.cpu_count() or 1)

    def needed_fields(self) -> dict[str, list[str]]:
        """Row field -> the reward functions that require it (for a check of every row)."""
        out: dict[str, list[str]] = {}
        for spec, fn in self.resolved:
            for name in needed_fields(fn, spec.kwargs):
                out.setdefault(name, []).append(spec.name)
        return out

    def _call(self, spec: RewardSpec, fn: RewardFn, completion: str,
              kwargs: dict[str, Any]) -> tuple[float | None, Any, BaseException | None]:
        """(value or None, sandbox result or None, exception or None) of one call; never
        raises."""
        try:
            if fn in _DETAILED:
                value, result = _DETAILED[fn](completion, **kwargs)
                return _value(value), result, None
            value = self._settle([fn(completion, **kwargs)])[0]
            if isinstance(value, BaseException):
                raise value
            return _value(value), None, None
        except Exception as exc:
            return math.nan, None, exc

    def _settle(self, values: list[Any]) -> list[Any]:
        """`values` with each awaitable awaited, all together on the run's event loop, each
        within `timeout_s`; an awaitable that raised or timed out gives its exception."""
        if not any(inspect.isawaitable(v) for v in values):
            return values

        async def one(value: Any) -> Any:
            if not inspect.isawaitable(value):
                return value
            try:
                return await asyncio.wait_for(value, self.timeout_s)
            except asyncio.TimeoutError:
                return TimeoutError(f"no value within reward_timeout_s={self.timeout_s}")
            except Exception as exc:  # noqa: BLE001 - the sample's error, recorded with it
                return exc

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(v) for v in values)))

        from posttrain.rollout.tools import resolve

        return resolve(every())

    def _call_async(self, jobs: list, completions: Sequence[str]) -> list[tuple]:
        """The calls of `async def` per-sample functions, awaited together (never raises)."""
        values = []
        for _, fn, i, kwargs in jobs:
            try:
                values.append(fn(completions[i], **kwargs))
            except Exception as exc:  # noqa: BLE001 - raised before its first await
                values.append(exc)
        return [_outcome(v) for v in self._settle(values)]

    def score(self, completions: Sequence[str], rows: Sequence[dict[str, Any]]) -> ScoreResult:
        """Score every completion with every function; ``rows[i]`` holds sample i's fields."""
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        per_sample = [(spec, fn) for spec, fn in self.resolved if call_style(fn) == PER_SAMPLE]
        jobs = [(spec, fn, i, call_arguments(fn, spec, rows[i], i))
                for spec, fn in per_sample if not is_async(fn) for i in range(len(completions))]
        with ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            outcomes = list(pool.map(lambda job: self._call(job[0], job[1], completions[job[2]],
                                                            job[3]), jobs))
        awaited = [(spec, fn, i, call_arguments(fn, spec, rows[i], i))
                   for spec, fn in per_sample if is_async(fn) for i in range(len(completions))]
        jobs += awaited
        outcomes += self._call_async(awaited, completions)
        for spec, fn in self.resolved:  # batched functions: one call each
            if call_style(fn) != PER_SAMPLE:
                jobs += [(spec, fn, i, spec.kwargs) for i in range(len(completions))]
                outcomes += self._call_batched(spec, fn, completions, rows)
        result = self._collect(completions, jobs, outcomes)
        for spec, fn in self.resolved:  # the calling rewards' latency, requests, retries
            for key, value in (fn.drain_metrics(spec.kwargs) if hasattr(fn, "drain_metrics")
                               else {}).items():
                result.metrics[f"reward/{_metric_name(spec.name)}/{key}"] = value
        return result

    def _call_batched(self, spec: RewardSpec, fn: RewardFn, completions: Sequence[str],
                      rows: Sequence[dict[str, Any]]) -> list[tuple[float | None, None, Any]]:
        """One call for the whole batch (``rows`` or TRL form); an error marks every sample."""
        try:
            if call_style(fn) == ROWS:
                values = fn(list(completions), list(rows), **spec.kwargs)
            else:
                kwargs = batched_arguments(fn, list(completions), list(rows), spec.kwargs)
                by_name = "completions" in inspect.signature(fn).parameters
                values = (fn(completions=list(completions), **kwargs) if by_name
                          else fn(list(completions), **kwargs))
            values = self._settle([values])[0]
            if isinstance(values, Exception):
                raise values
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise TypeError(f"a batched reward must return a list of floats, got "
                                f"{type(values).__name__}")
            if len(values) != len(completions):
                raise ValueError(f"returned {len(values)} values for {len(completions)} samples")
            return [_outcome(v) for v in self._settle(list(values))]
        except Exception as exc:
            return [(math.nan, None, exc)] * len(completions)

    def _collect(self, completions: Sequence[str], jobs: list, outcomes: list) -> ScoreResult:
        """Per-function values (NaN where a function returned None: it does not score that
        sample), the weighted sums over the functions that scored each sample (0 for a sample
        none scored: TRL's rule, counted in `reward/unscored` and recorded), and the errors."""
        n = len(completions)
        per_function = {spec.name: [0.0] * n for spec, _ in self.resolved}
        unscorable, applies = [False] * n, [False] * n
        errors: list[dict[str, Any]] = []
        counters = dict.fromkeys((*STATUSES, "in_process_verdicts"), 0)
        error_counts = dict.fromkeys(per_function, 0)
        first: dict[str, tuple[int, BaseException]] = {}
        for (spec, _, i, _), (value, result, exc) in zip(jobs, outcomes, strict=True):
            if isinstance(exc, UnscorableError):
                unscorable[i], value = True, math.nan
            elif exc is not None:
                # a sandbox that refuses to run (strict mode) is a set-up error, never a zero
                if self.on_error == "raise" or isinstance(exc, SandboxUnavailableError):
                    raise RewardFunctionError(spec.name, i, exc, completions[i]) from exc
                error_counts[spec.name] += 1
                first.setdefault(spec.name, (i, exc))
                errors.append({"function": spec.name, "index": i, "error": repr(exc),
                               "completion": completions[i][:_EXCERPT_CHARS]})
                value = 0.0
            if value is None:  # this function does not score this sample (TRL's None)
                value = math.nan
            else:
                applies[i] = True
            if result is not None:  # a SandboxResult
                counters[result.status] += 1
                counters["in_process_verdicts"] += result.in_process_verdicts
            per_function[spec.name][i] = value
        self._stop_if_mostly_failing(error_counts, first, completions)
        scores = [math.nan if unscorable[i] else
                  sum(spec.weight * per_function[spec.name][i] for spec, _ in self.resolved
                      if not math.isnan(per_function[spec.name][i])) + 0.0
                  for i in range(n)]
        unscored = [not (a or u) for a, u in zip(applies, unscorable, strict=True)]
        errors += [{"function": None, "index": i, "error": "no reward function scored this "
                    "sample (each returned None); scored 0", "completion":
                    completions[i][:_EXCERPT_CHARS]} for i in range(n) if unscored[i]]
        metrics = _metrics(per_function, scores, unscorable, error_counts,
                           counters if any(fn in _DETAILED for _, fn in self.resolved) else None)
        metrics["reward/unscored"] = float(sum(unscored))
        return ScoreResult(scores, per_function, metrics, errors)

    def _stop_if_mostly_failing(self, error_counts: dict[str, int],
                                first: dict[str, tuple[int, BaseException]],
                                completions: Sequence[str]) -> None:
        """on_error=auto: a function that failed on more than half the samples stops the run."""
        if self.on_error != "auto":
            return
        for name, count in error_counts.items():
            if count * 2 > len(completions):
                i, exc = first[name]
                raise RewardFunctionError(
                    name, i, exc, completions[i],
                    note=f"it failed on {count} of {len(completions)} samples; set "
                         "reward_on_error: zero to score failures 0 and go on") from exc


def is_async(fn: RewardFn) -> bool:
    """An `async def` function (or an object whose `__call__` is one)."""
    call = type(fn).__call__ if not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _outcome(value: Any) -> tuple[float | None, None, BaseException | None]:
    """(value, None, error) of one sample's value: an exception (a batched function may give
    one per sample: the remote and judge rewards) or a non-finite value is that sample's
    error."""
    if isinstance(value, BaseException):
        return math.nan, None, value
    try:
        return _value(value), None, None
    except (TypeError, ValueError) as exc:
        return math.nan, None, exc


def _value(value: Any) -> float | None:
    """A reward function's value: None (it does not score this sample) or a finite float; a
    NaN or infinite value is a ValueError (a reward error, recorded with its sample)."""
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value} (a reward must be a finite number, or None when "
                         "the function does not score the sample)")
    return value


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _metric_name(name: str) -> str:
    return re.sub(r"[^\w.\-]+", ".", name)


def _metrics(per_function: dict[str, list[float]], scores: list[float], unscorable: list[bool],
             error_counts: dict[str, int], counters: dict[str, int] | None) -> dict[str, float]:
    metrics: dict[str, float] = {"reward/mean": _mean(scores),
                                 "reward/unscorable": float(sum(unscorable))}
    for name, values in per_function.items():
        metrics[f"reward/{_metric_name(name)}_mean"] = _mean(values)
        metrics[f"reward/errors/{_metric_name(name)}"] = float(error_counts[name])
    if counters is not None:
        for status, count in counters.items():
            metrics[f"code/{status}"] = float(count)
    return metrics
