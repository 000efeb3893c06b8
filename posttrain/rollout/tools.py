"""Tools and environments of multi-turn rollouts (TRL's contract): what the model may call,
how a call is read from its text, and how it runs.

- `tools=[f, ...]`: typed functions with Google-style docstrings (schemas from
  `get_json_schema`); `async def` tools are awaited on the run's one event loop.
- `environment_factory=Cls | {name: Cls}`: one instance per rollout, `reset(**row)` first, its
  public methods are tools; checked before any model loads.
- Calls: in the family's own format (`posttrain.rollout.call_formats`).
- Failure is data: anything the model wrote that fails (parse, unknown tool, arguments,
  exception, timeout, over the turn's limit) is the answer text, never an exception.
- A call reported timed out never starts later; its environment is closed (`Toolbox.closed`).
- `python`: model code in `posttrain.sandbox` (bwrap unless `sandbox_mode: limits`), within
  the process's one bound on sandboxes (`posttrain.sandbox.SANDBOXES`).
More: docs/agents.md, "Module notes", posttrain.rollout.tools.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from posttrain.rollout.call_formats import raw_calls

__all__ = ["ERROR_KINDS", "TOOL_CALL", "AgentSpec", "ToolCall", "ToolResult", "Toolbox",
           "call_tools", "check_environment", "check_environment_rows", "env_tools",
           "parse_tool_calls", "python", "python_containment", "resolve", "tool_schemas"]

TOOL_CALL = ("<tool_call>", "</tool_call>")
"""The fallback call format's tags (tokenizers whose template defines no response schema)."""
ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "exception", "timeout", "too_many")
"""The kinds of failed call, each a counter `agent/tool_errors/<kind>`."""
MAX_CALLS_PER_TURN = 8
"""Default of `max_tool_calls_per_turn`."""
TURN_TIMEOUT_S = 30.0
"""Default of `tool_turn_timeout_s`."""


def _text(s: str) -> str:
    """`s` as valid UTF-8: a lone surrogate (a JSON escape the model wrote, echoed by a tool)
    would make the tokenizer raise."""
    return s.encode("utf-8", "replace").decode("utf-8")


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ToolResult:
    name: str
    content: str
    error: str | None = None
    """One of `ERROR_KINDS`, or None when the tool answered."""

    def __post_init__(self) -> None:
        self.name, self.content = _text(self.name), _text(self.content)


_CALL = threading.local()
"""The running call's `deadline` (`time.monotonic()`), for tools that bound themselves."""
_SANDBOX_MODE = {"mode": "strict"}
"""The `python` tool's sandbox mode (`python_containment`): bubblewrap or nothing by default."""
_SAID: set[str] = set()


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: a Python program; its standard output is the answer.
    """
    from posttrain.sandbox import SANDBOXES, SandboxLimits, run_sandboxed
    from posttrain.sandbox.jail import script_answer

    deadline = getattr(_CALL, "deadline", math.inf)
    if not SANDBOXES.acquire(timeout=None if deadline == math.inf
                             else max(0.0, deadline - time.monotonic())):
        raise TimeoutError("no sandbox was free before the call's time ran out")
    try:
        left = deadline - time.monotonic()
        if left <= 0:  # reported timed out already: never start it
            raise TimeoutError("no time left")
        # the program's own limit ends before the call's (2 s for the sandbox to start, end
        # the program and answer), so a program that runs too long is an answer, not a
        # timed-out call
        limits = SandboxLimits(timeout_s=max(0.1, min(SandboxLimits.timeout_s, left - 2.0)))
        result = run_sandboxed(code, limits=limits, mode=_SANDBOX_MODE["mode"])
    finally:
        SANDBOXES.release()
    return script_answer(result, limits.timeout_s)  # the program's failure is its answer


def python_mode(mode: str | None = None) -> str:
    """The `python` tool's sandbox mode (`strict` or `limits`); with `mode`, set it first
    (a spawned process, e.g. the async sampler, takes its parent's: module state is not
    inherited)."""
    if mode is not None:
        if mode not in ("strict", "limits"):
            raise ValueError(f"python tool sandbox mode {mode!r}; expected strict or limits")
        _SANDBOX_MODE["mode"] = mode
    return _SANDBOX_MODE["mode"]


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"python": python}


def python_containment(mode: str) -> str:
    """Set the `python` tool's containment from config `sandbox_mode` and say it once, in one
    line: `bwrap` (bubblewrap; refused in one line where it does not run here) or `limits`
    (resource limits only, never chosen for the user)."""
    from posttrain.sandbox import SandboxUnavailableError, run_sandboxed

    if mode not in ("bwrap", "limits"):
        raise ValueError(f"config key 'sandbox_mode': {mode!r}; expected bwrap or limits")
    if mode == "bwrap":
        try:
            run_sandboxed("", mode="strict")
        except SandboxUnavailableError as err:
            raise ValueError(f"config key 'sandbox_mode': the python tool runs model code in "
                             f"bubblewrap, which does not work here ({err}); set sandbox_mode: "
                             "limits to run it with resource limits only (no file-system or "
                             "network isolation; docs/sandbox.md)") from err
    _SANDBOX_MODE["mode"] = "strict" if mode == "bwrap" else "limits"
    line = ("[posttrain] python tool: model code runs in bubblewrap (no network, no host data, "
            "private /tmp, resource limits; docs/sandbox.md)" if mode == "bwrap" else
            "[posttrain] python tool: model code runs with resource limits only (sandbox_mode: "
            "limits): NO file-system or network isolation; docs/sandbox.md")
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)
    return mode


_LOOP: list[asyncio.AbstractEventLoop] = []
_LOOP_LOCK = threading.Lock()


def resolve(value: Any, deadline: float = math.inf) -> Any:
    """`value`, or, when it is awaitable (an `async def` tool or `get_reward`), its result
    awaited on the run's one event loop (a daemon thread), cancelled at `deadline`."""
    if not inspect.isawaitable(value):
        return value
    with _LOOP_LOCK:
        if not _LOOP:
            _LOOP.append(asyncio.new_event_loop())
            threading.Thread(target=_LOOP[0].run_forever, name="posttrain-async-tools",
                             daemon=True).start()

    async def result() -> Any:
        return await value

    fut = asyncio.run_coroutine_threadsafe(result(), _LOOP[0])
    try:
        return fut.result(None if deadline == math.inf else max(0.0, deadline - time.monotonic()))
    finally:
        fut.cancel()  # past the deadline: the coroutine stops at its next await


def tool_schemas(fns: list[Callable[..., Any]], key: str = "tools", owner: str = ""
                 ) -> list[dict[str, Any]]:
    """The JSON schema of each tool (`transformers.utils.get_json_schema`); a function without
    type hints or a Google-style docstring is refused in one line naming it."""
    from transformers.utils import get_json_schema

    out = []
    for fn in fns:
        try:
            out.append(get_json_schema(fn))
        except Exception as err:
            raise ValueError(f"config key {key!r}: {owner}{getattr(fn, '__name__', fn)!r} needs "
                             f"type hints and a Google-style docstring with Args: ({err})"
                             ) from err
    return out


def env_tools(env: Any) -> dict[str, Callable[..., Any]]:
    """An environment instance's tools: its public methods except `reset` and `get_reward`."""
    names = [n for n, _ in inspect.getmembers(type(env), callable)
             if not n.startswith("_") and n not in ("reset", "get_reward")]
    return {n: getattr(env, n) for n in names}


def check_environment(factory: Any, name: str = "") -> None:
    """Refuse in one line, before any model loads, what TRL refuses at init: an instance
    instead of the class, a class without a callable (synchronous) `reset`, a public method
    without a schema. A factory function is checked at its first rollout."""
    where = "config key 'environment'" + (f" ({name!r})" if name else "")
    if not isinstance(factory, type):
        if callable(factory) and not hasattr(factory, "reset"):
            return
        raise ValueError(f"{where}: got an instance of {type(factory).__name__}, not a class; "
                         "pass the class itself (one instance is made per rollout)")
    reset = getattr(factory, "reset", None)
    if not callable(reset) or inspect.iscoroutinefunction(reset):
        raise ValueError(f"{where}: {factory.__name__} needs a method reset(self, **row) -> str "
                         "| None (synchronous), called with the row before each rollout")
    try:
        blank = factory.__new__(factory)  # its bound methods, without running __init__
    except Exception:
        return
    tool_schemas(list(env_tools(blank).values()), "environment", f"{factory.__name__}.")


def check_environment_rows(spec: AgentSpec | None, rows: Iterable[dict[str, Any]],
                           source: str = "train_data") -> None:
    """With a `{name: Cls}` factory, refuse (one line, naming the first bad row) a row whose
    `environment` field names no known environment."""
    if spec is None or not isinstance(spec.factory, dict):
        return
    for i, row in enumerate(rows, 1):
        name = row.get("environment")
        if not isinstance(name, str) or name not in spec.factory:
            raise ValueError(f"config key 'environment': row {i} of {source} has environment="
                             f"{name!r}; each row names one of {sorted(spec.factory)} in its "
                             "'environment' field")


def _import(path: str, key: str) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"config key {key!r}: {path!r} is not 'pkg.module:name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"config key {key!r}: cannot import {path!r}: {err}") from err


class Toolbox(dict):
    """One episode's tools (name -> callable) with the limits of its turns. `closed` once a
    call on its environment timed out: the environment's methods then answer an error without
    running (the timed-out call may still run in its thread; nothing else may touch that
    state, and a reward should not read it)."""

    def __init__(self, fns: dict[str, Callable[..., Any]], env: Any = None,
                 max_calls: int = MAX_CALLS_PER_TURN, turn_timeout_s: float = TURN_TIMEOUT_S
                 ) -> None:
        super().__init__(fns)
        self.env, self.max_calls, self.turn_timeout_s = env, max_calls, turn_timeout_s
        self.closed = False

    def on_env(self, fn: Any) -> bool:
        return self.env is not None and getattr(fn, "__self__", None) is self.env


@dataclass
class AgentSpec:
    """What the episodes of a run may call: plain tools and/or an environment factory."""

    tools: dict[str, Callable[..., Any]] = field(default_factory=dict)
    factory: type | dict[str, type] | None = None
    max_turns: int = 4
    """Most tool-calling rounds (max_tool_calling_iterations)."""
    timeout_s: float = 10.0
    max_calls: int = MAX_CALLS_PER_TURN
    """Most calls one turn of an episode runs (max_tool_calls_per_turn)."""
    turn_timeout_s: float = TURN_TIMEOUT_S
    """Wall-clock limit of one turn's calls of an episode (tool_turn_timeout_s)."""

    @classmethod
    def build(cls, cfg: Any, tools: list[Any] | None = None, factory: Any = None
              ) -> AgentSpec | None:
        """From Python objects (`tools=`, `environment_factory=`) or the config's import paths;
        None when the run has neither. Everything is checked here, before any model loads."""
        if tools is None:
            tools = [BUILTIN_TOOLS.get(t) or _import(t, "tools") for t in cfg.tools]
        if factory is None and cfg.environment:
            env = cfg.environment
            factory = ({k: _import(v, "environment") for k, v in env.items()}
                       if isinstance(env, dict) else _import(env, "environment"))
        if not tools and factory is None:
            return None
        fns = {getattr(f, "__name__", str(f)): f for f in tools}
        tool_schemas(list(fns.values()))
        for name, f in (factory.items() if isinstance(factory, dict) else [("", factory)]):
            if f is not None:
                check_environment(f, name)
        if fns.get("python") is python:
            python_containment(getattr(cfg, "sandbox_mode", "bwrap"))
        return cls(fns, factory, cfg.max_tool_calling_iterations, cfg.tool_timeout_s,
                   getattr(cfg, "max_tool_calls_per_turn", cls.max_calls),
                   getattr(cfg, "tool_turn_timeout_s", cls.turn_timeout_s))

    def classes(self) -> list[type]:
        if self.factory is None:
            return []
        return list(self.factory.values()) if isinstance(self.factory, dict) else [self.factory]

    def new_environment(self, row: dict[str, Any]) -> Any:
        """One environment instance for a rollout of `row` (None without a factory)."""
        if isinstance(self.factory, dict):
            check_environment_rows(self, [row], "this rollout")
            return self.factory[row["environment"]]()
        return self.factory() if self.factory is not None else None

    def episode_tools(self, env: Any) -> Toolbox:
        """The tools of one episode: the plain tools plus its environment's methods."""
        return Toolbox({**self.tools, **(env_tools(env) if env is not None else {})}, env,
                       self.max_calls, self.turn_timeout_s)


def parse_tool_calls(tokenizer: Any, text: str, fmt: str | None = None
                     ) -> list[ToolCall] | str:
    """The tool calls of one model turn's text (decoded with its special tokens), or an error
    message when one does not parse.

    `fmt`: a format of `posttrain.rollout.call_formats` (`detect_format`); None: the
    tokenizer's `parse_response` where it has a response template, else `hermes` (every
    `<tool_call>{"name": str, "arguments": dict}</tool_call>` block). [] when there is none.
    Whatever the text holds this returns: every failure to parse (bad JSON, nesting too deep,
    a number too long, the tokenizer's parser raising) is the message."""
    try:
        return _parse(tokenizer, text, fmt)
    except Exception as err:  # RecursionError, ValueError, ...: what the model wrote is data
        return f"the tool call could not be parsed: {type(err).__name__}: {str(err)[:300]}"


def _parse(tokenizer: Any, text: str, fmt: str | None) -> list[ToolCall] | str:
    if fmt is None:
        fmt = ("response_template" if getattr(tokenizer, "response_template", None)
               or getattr(tokenizer, "response_schema", None) else "hermes")
    calls = raw_calls(tokenizer, fmt, text)
    if isinstance(calls, str):
        return calls
    out = []
    for c in calls:
        args = c.get("arguments", {}) if isinstance(c, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                args = None
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(
                args, dict):
            return 'a tool call needs {"name": str, "arguments": {...}}'
        out.append(ToolCall(c["name"], args))
    return out


def _run_one(fns: dict[str, Callable[..., Any]], call: ToolCall,
             deadline: float = math.inf) -> ToolResult:
    fn = fns.get(call.name)
    if fn is None:
        return ToolResult(call.name, f"error: unknown tool {call.name!r}; tools: "
                          f"{sorted(fns)}", "unknown_tool")
    if isinstance(fns, Toolbox) and fns.closed and fns.on_env(fn):
        return ToolResult(call.name, f"error: {call.name} not run: an earlier call on this "
                          "environment timed out", "timeout")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as err:
        return ToolResult(call.name, f"error: bad arguments for {call.name}: {err}",
                          "bad_arguments")
    _CALL.deadline = deadline
    try:
        return ToolResult(call.name, str(resolve(fn(**call.arguments), deadline)))
    except BaseException as err:  # SystemExit too: what a tool raises is data
        if time.monotonic() >= deadline:  # e.g. an async tool cancelled at its deadline
            return ToolResult(call.name, f"error: {call.name} timed out", "timeout")
        return ToolResult(call.name, f"error: {type(err).__name__}: {err}", "exception")


def _spawn(fn: Callable[..., ToolResult], *args: Any) -> Future:
    """`fn(*args)` on a new daemon thread (a call that hangs never holds up the exit)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as err:
            fut.set_exception(err)

    threading.Thread(target=run, name="posttrain-tool", daemon=True).start()
    return fut


def call_tools(jobs: list[tuple[dict[str, Callable[..., Any]], list[ToolCall]]],
               timeout_s: float) -> list[list[ToolResult]]:
    """Run the calls of every episode of a turn: episodes concurrently, one episode's calls in
    order (an environment is stateful), each call within `timeout_s` of its start, an
    episode's calls within its `Toolbox.turn_timeout_s`, at most its `Toolbox.max_calls` (the
    rest answer `too_many` without running).

    Calls start here only, one at a time per episode, each once the last one answered, never
    after this returns: a call past its limit answers `timeout`, and its episode's remaining
    calls answer without running. Its thread cannot be killed (an async tool is cancelled at
    its next await): a daemon thread finishes it in the background, and its episode's
    environment is closed (`Toolbox.closed`)."""
    start = time.monotonic()
    out: list[list[ToolResult]] = [[] for _ in jobs]
    why: list[str] = ["" for _ in jobs]  # why an episode's remaining calls did not run
    running: dict[Future, tuple[int, float, str]] = {}  # -> episode, deadline, timeout text

    def submit(k: int) -> None:
        fns, calls = jobs[k]
        turn = getattr(fns, "turn_timeout_s", TURN_TIMEOUT_S)
        i, now = len(out[k]), time.monotonic()
        if i >= min(len(calls), getattr(fns, "max_calls", MAX_CALLS_PER_TURN)) or why[k]:
            return
        if now >= start + turn:
            why[k] = f"the turn's {turn:g} s for tool calls ran out"
            return
        deadline, name = min(now + timeout_s, start + turn), calls[i].name
        text = (f"error: {name} timed out after {timeout_s:g} s" if deadline == now + timeout_s
                else f"error: {name} timed out: the turn's {turn:g} s for tool calls ran out")
        running[_spawn(_run_one, fns, calls[i], deadline)] = (k, deadline, text)

    for k in range(len(jobs)):
        submit(k)
    while running:
        soonest = min(d for _, d, _ in running.values())
        wait(running, max(0.0, soonest - time.monotonic()), FIRST_COMPLETED)
        now = time.monotonic()
        for fut, (k, deadline, text) in list(running.items()):
            fns, calls = jobs[k]
            call = calls[len(out[k])]
            if fut.done():
                del running[fut]
                err = fut.exception()
                out[k].append(fut.result() if err is None else ToolResult(
                    call.name, f"error: {type(err).__name__}", "exception"))
                submit(k)
            elif now >= deadline:
                del running[fut]
                out[k].append(ToolResult(call.name, text, "timeout"))
                why[k] = f"an earlier call ({call.name}) timed out"
                if isinstance(fns, Toolbox) and fns.on_env(fns.get(call.name)):
                    fns.closed = True
    return [got + [_not_run(c, i, fns, why[k]) for i, c in enumerate(calls[len(got):], len(got))]
            for k, (got, (fns, calls)) in enumerate(zip(out, jobs, strict=True))]


def _not_run(call: ToolCall, index: int, fns: dict[str, Any], why: str) -> ToolResult:
    most = getattr(fns, "max_calls", MAX_CALLS_PER_TURN)
    if index >= most:
        return ToolResult(call.name, f"error: {call.name} not run: at most {most} tool calls "
                          "per turn", "too_many")
    return ToolResult(call.name, f"error: {call.name} not run: {why}", "timeout")
