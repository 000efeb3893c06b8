"""Tools and environments of multi-turn rollouts (TRL's contract): what the model may call,
how a call is read from its text, and how it runs.

- `tools=[f, ...]`: typed functions with Google-style docstrings; their JSON schemas come from
  `transformers.utils.get_json_schema` and reach the prompt through the chat template.
- `environment_factory=Cls` or `{name: Cls}`: one instance per rollout, `reset(**row) -> str |
  None` first, its public methods (not `reset`, not `get_reward`) are its tools.
- A call is parsed with the tokenizer's own `parse_response` where its template defines a
  response schema, else from the fallback format `TOOL_CALL` (Hermes / Qwen2.5 style, which
  the demo's character tokenizer can write): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, any number per turn.
- Failure is data: an unparsable call, an unknown tool, wrong arguments, an exception or a
  timeout becomes the answer text (`ToolResult.error` names the kind, counted in metrics).
- `python`: the built-in tool that runs model-written code in `posttrain.sandbox` (never in
  the trainer's process), with code_reward's default limits.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ERROR_KINDS", "TOOL_CALL", "AgentSpec", "ToolCall", "ToolResult", "call_tools",
           "env_tools", "parse_tool_calls", "python", "tool_schemas"]

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
"""The fallback call format (tokenizers whose template defines no response schema)."""
ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "exception", "timeout")
"""The kinds of failed call, each a counter `agent/tool_errors/<kind>`."""


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


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: a Python program; its standard output is the answer.
    """
    from posttrain.sandbox import run_sandboxed

    result = run_sandboxed(code)
    if result.status != "passed":
        raise RuntimeError(f"{result.status}: {(result.detail or result.stderr)[-300:]}")
    return result.stdout


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"python": python}


def tool_schemas(fns: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each tool (`transformers.utils.get_json_schema`); a function without
    type hints or a Google-style docstring is refused in one line naming it."""
    from transformers.utils import get_json_schema

    out = []
    for fn in fns:
        try:
            out.append(get_json_schema(fn))
        except Exception as err:
            raise ValueError(f"config key 'tools': {getattr(fn, '__name__', fn)!r} needs type "
                             f"hints and a Google-style docstring with Args: ({err})") from err
    return out


def env_tools(env: Any) -> dict[str, Callable[..., Any]]:
    """An environment instance's tools: its public methods except `reset` and `get_reward`."""
    names = [n for n, _ in inspect.getmembers(type(env), callable)
             if not n.startswith("_") and n not in ("reset", "get_reward")]
    return {n: getattr(env, n) for n in names}


def _import(path: str, key: str) -> Any:
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"config key {key!r}: {path!r} is not 'pkg.module:name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"config key {key!r}: cannot import {path!r}: {err}") from err


@dataclass
class AgentSpec:
    """What the episodes of a run may call: plain tools and/or an environment factory."""

    tools: dict[str, Callable[..., Any]] = field(default_factory=dict)
    factory: type | dict[str, type] | None = None
    max_turns: int = 4
    """Most tool-calling rounds (max_tool_calling_iterations)."""
    timeout_s: float = 10.0

    @classmethod
    def build(cls, cfg: Any, tools: list[Any] | None = None, factory: Any = None
              ) -> AgentSpec | None:
        """From Python objects (`tools=`, `environment_factory=`) or the config's import paths;
        None when the run has neither."""
        if tools is None:
            tools = [BUILTIN_TOOLS.get(t) or _import(t, "tools") for t in cfg.tools]
        if factory is None and cfg.environment:
            env = cfg.environment
            factory = ({k: _import(v, "environment") for k, v in env.items()}
                       if isinstance(env, dict) else _import(env, "environment"))
        if not tools and factory is None:
            return None
        fns = {getattr(f, "__name__", str(f)): f for f in tools}
        tool_schemas(list(fns.values()))  # refused here, before any model loads
        return cls(fns, factory, cfg.max_tool_calling_iterations, cfg.tool_timeout_s)

    def classes(self) -> list[type]:
        if self.factory is None:
            return []
        return list(self.factory.values()) if isinstance(self.factory, dict) else [self.factory]

    def new_environment(self, row: dict[str, Any]) -> Any:
        """One environment instance for a rollout of `row` (None without a factory)."""
        if isinstance(self.factory, dict):
            name = row.get("environment")
            if name not in self.factory:
                raise ValueError(f"config key 'environment': the row's 'environment' field is "
                                 f"{name!r}; known: {sorted(self.factory)}")
            return self.factory[name]()
        return self.factory() if self.factory is not None else None

    def episode_tools(self, env: Any) -> dict[str, Callable[..., Any]]:
        """The tools of one episode: the plain tools plus its environment's methods."""
        return {**self.tools, **(env_tools(env) if env is not None else {})}


def parse_tool_calls(tokenizer: Any, text: str) -> list[ToolCall] | str:
    """The tool calls of one model turn's text, or an error message when one does not parse.

    With a response schema on the tokenizer (`parse_response`), its `tool_calls`; else every
    `<tool_call>{"name": str, "arguments": dict}</tool_call>` block. [] when there is none."""
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema",
                                                                 None):
        try:
            raw = tokenizer.parse_response(text).get("tool_calls") or []
        except Exception as err:
            return f"the tool call could not be parsed: {err}"
        calls = [c.get("function", c) for c in raw]
    else:
        calls = []
        for block in TOOL_CALL.findall(text):
            try:
                calls.append(json.loads(block))
            except json.JSONDecodeError as err:
                return f"the tool call is not valid JSON: {err}"
        if not calls and "<tool_call>" in text:
            return "the tool call has no closing </tool_call>"
    out = []
    for c in calls:
        args = c.get("arguments", {}) if isinstance(c, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(
                args, dict):
            return 'a tool call needs {"name": str, "arguments": {...}}'
        out.append(ToolCall(c["name"], args))
    return out


def _run_one(fns: dict[str, Callable[..., Any]], call: ToolCall) -> ToolResult:
    fn = fns.get(call.name)
    if fn is None:
        return ToolResult(call.name, f"error: unknown tool {call.name!r}; tools: "
                          f"{sorted(fns)}", "unknown_tool")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as err:
        return ToolResult(call.name, f"error: bad arguments for {call.name}: {err}",
                          "bad_arguments")
    try:
        return ToolResult(call.name, str(fn(**call.arguments)))
    except Exception as err:
        return ToolResult(call.name, f"error: {type(err).__name__}: {err}", "exception")


def call_tools(jobs: list[tuple[dict[str, Callable[..., Any]], list[ToolCall]]],
               timeout_s: float) -> list[list[ToolResult]]:
    """Run the calls of every episode of a turn: episodes concurrently, one episode's calls in
    order (an environment is stateful), each episode within `timeout_s` x its number of calls.

    Calls still unanswered at the limit answer with a timeout message; the thread cannot be
    killed and finishes in the background (a tool that may hang should bound itself, as the
    sandboxed `python` tool does)."""
    if not jobs:
        return []
    pool = ThreadPoolExecutor(max_workers=len(jobs))
    done: list[list[ToolResult]] = [[] for _ in jobs]

    def run(k: int) -> None:
        fns, calls = jobs[k]
        for call in calls:
            done[k].append(_run_one(fns, call))

    start = time.monotonic()
    futures = [pool.submit(run, k) for k in range(len(jobs))]
    for k, fut in enumerate(futures):
        limit = start + timeout_s * len(jobs[k][1]) - time.monotonic()
        with contextlib.suppress(FutureTimeout):
            fut.result(timeout=max(0.0, limit))
    pool.shutdown(wait=False, cancel_futures=True)
    out = []
    for k, (_, calls) in enumerate(jobs):
        got = list(done[k])  # a snapshot: a late answer does not land after the limit
        out.append(got + [ToolResult(c.name, f"error: {c.name} timed out after {timeout_s:g} s",
                                     "timeout") for c in calls[len(got):]])
    return out
