"""Code reward (formulas §10): run the completion's program against unit tests in a sandbox.

``code_reward(completion, tests)`` returns 1.0 when every test passes (``partial=True``: the
fraction passed); timeouts, crashes and any misbehaviour score 0 for the tests they affect. The
program is the completion's fenced code blocks (:func:`extract_program`), else all of it.
Tests: a list of assert snippets or ``{"input", "output"}`` dicts, or one string, cut so that
test *k* passes exactly when plain Python gets past its *k*-th top-level assert (the last test
is the whole string; no top-level assert: one test); any other shape is a ``ValueError``.
Each test runs in fresh processes; literal asserts and stdin/stdout tests are compared here,
type-strictly, any other assert in a judge process on proxies (:mod:`posttrain.sandbox.tests`,
docs/sandbox.md), never by what it prints. ``timeout_s`` bounds each test (wall clock and CPU);
``partial=False`` stops at the first failing test.
More: docs/rewards.md, "Module notes", posttrain.rewards.code.
"""

from __future__ import annotations

import ast
import logging
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from posttrain.sandbox import SANDBOXES
from posttrain.sandbox.jail import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    run_sandboxed,
)
from posttrain.sandbox.tests import AST_LOCK, CompareOptions, parse_test

Compare = CompareOptions | Mapping[str, Any] | None

_OPEN = re.compile(r"^ {0,3}(?P<fence>`{3,}(?=[^`]*$)|~{3,})[ \t]*(?P<info>\S*)")
_LABELS = ("", "python", "python3", "py", "py3")
_SOLUTION = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
logger = logging.getLogger(__name__)


def code_blocks(completion: str) -> list[tuple[str, str]]:
    """``(label, body)`` of each fenced block, CommonMark-style: a fence is a line of 3+
    backticks or tildes (a backtick fence's info string has no backtick); it closes at a line of
    at least as many of the same character and nothing else; an unclosed block runs to the end.
    Backticks inside a line of code never close a block."""
    lines = completion.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        opened = _OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        fence = opened["fence"]
        close = re.compile(r"^ {0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) +
                           r",}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        body = "\n".join(lines[i + 1:end])
        blocks.append((opened["info"].lower(), body + "\n" if end < len(lines) else body))
        i = end + 1
    return blocks


def _is_solution(body: str) -> bool:
    """A block that defines a top-level function or class, or holds only imports."""
    try:
        with AST_LOCK:
            module = ast.parse(body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # model text: never a stop
        return False
    return any(isinstance(node, _SOLUTION) for node in module.body) or bool(module.body) and \
        all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in module.body)


def extract_program(completion: str) -> str:
    """The program in a completion (docs/code_rl.md, "Which code is graded").

    Python blocks are the fenced blocks labelled ``python``, ``python3``, ``py``, ``py3`` or
    unlabelled (``~~~`` fences too). When some of them define a function or class (or hold only
    imports), the program is those blocks joined in order (a later definition wins), so a usage
    example after the solution (``print(f(3))``) is not graded; otherwise it is the last python
    block (a script); without any python block, the whole completion.
    """
    python = [body for label, body in code_blocks(completion) if label in _LABELS]
    if not python:
        return completion
    solution = [body for body in python if _is_solution(body)]
    if not solution:
        return python[-1]
    return "".join(body if body.endswith("\n") else body + "\n" for body in solution)


def split_tests(tests: str | Sequence[str | dict]) -> list[str | dict]:
    """One snippet (or stdin/stdout dict) per test (see the module docstring). Raises ValueError
    on a test that does not compile or has an unknown shape - a dataset error, not the
    policy's."""
    if isinstance(tests, str):
        with AST_LOCK:
            try:
                module = ast.parse(tests)
            except SyntaxError as exc:
                raise ValueError(f"tests do not compile: {exc}") from exc
            ends = [i for i, node in enumerate(module.body) if isinstance(node, ast.Assert)]
            snippets = [ast.unparse(ast.Module(body=module.body[:end + 1], type_ignores=[]))
                        for end in ends[:-1]]
        snippets.append(tests)  # the last test is the whole string, run as plain Python runs it
    elif isinstance(tests, (list, tuple)):
        snippets = list(tests)
    else:
        raise ValueError(f"tests must be a string or a list, got {type(tests).__name__}")
    if not snippets:
        raise ValueError("no tests given: a code task needs at least one test")
    for index, snippet in enumerate(snippets):
        parse_test(snippet, index)  # raises on a bad snippet or an unknown shape
    return snippets


def with_imports(tests: str | Sequence[str | dict], test_imports: str | Sequence[str] | None
                 ) -> str | Sequence[str | dict]:
    """``tests`` with the row's ``test_imports`` (MBPP's field: ``["import math", ...]``) put
    before every assert test, so the test imports what it uses itself and never relies on a
    module of the same name that the program bound (that one is the program's)."""
    if not test_imports or not isinstance(tests, (str, list, tuple)):
        return tests  # split_tests says what is wrong with a bad tests field
    lines = [test_imports] if isinstance(test_imports, str) else list(test_imports)
    if not all(isinstance(line, str) for line in lines):
        raise ValueError("test_imports must be a string or a list of strings")
    head = "".join(line.rstrip("\n") + "\n" for line in lines)
    if isinstance(tests, str):
        return head + tests
    return [head + item if isinstance(item, str) else item for item in tests]


def code_reward_detailed(completion: str, tests: str | Sequence[str | dict],
                         timeout_s: float = 5.0, partial: bool = False, *, mode: str = "auto",
                         limits: SandboxLimits | None = None, compare: Compare = None,
                         test_imports: str | Sequence[str] | None = None
                         ) -> tuple[float, SandboxResult]:
    """``code_reward`` plus the sandbox result (status for the per-reason counters)."""
    snippets = split_tests(with_imports(tests, test_imports))
    limits = replace(limits or SandboxLimits(), timeout_s=timeout_s)
    with SANDBOXES:
        result = run_sandboxed(extract_program(completion), snippets, limits=limits, mode=mode,
                               stop_on_failure=not partial, compare=compare)
    if partial:
        return result.tests_passed / result.tests_total, result
    return (1.0 if result.status == "passed" else 0.0), result


def code_reward(completion: str, tests: str | list[str | dict], timeout_s: float = 5.0,
                partial: bool = False, *, mode: str = "auto",
                limits: SandboxLimits | None = None, compare: Compare = None,
                test_imports: str | Sequence[str] | None = None) -> float:
    """1.0 if the program passes every test (``partial``: fraction passed), else 0.0.

    ``mode``: sandbox mode (``auto`` | ``bwrap`` | ``strict`` | ``limits``, docs/sandbox.md);
    ``limits``: resource limits (their ``timeout_s`` is replaced by this ``timeout_s``);
    ``compare``: :class:`~posttrain.sandbox.tests.CompareOptions` or a dict of them
    (float tolerance, ``int_float``, ``bool_int``, stdout matching); ``test_imports``: a
    row's import lines (MBPP), put before every assert test (:func:`with_imports`).
    """
    return code_reward_detailed(completion, tests, timeout_s, partial, mode=mode,
                                limits=limits, compare=compare, test_imports=test_imports)[0]


def code_rewards_batch(completions: Sequence[str],
                       tests_list: Sequence[str | Sequence[str | dict]],
                       timeout_s: float = 5.0, partial: bool = False, *, mode: str = "auto",
                       limits: SandboxLimits | None = None, max_workers: int | None = None,
                       compare: Compare = None) -> list[float]:
    """``code_reward`` over many completions with a bounded pool (default: one per core; a
    larger pool still runs at most ``SANDBOXES`` sandboxes at once).

    Each run is bounded by its own deadline, so the batch never waits on one stuck program for
    longer than that program's limit. One item that cannot be scored (a malformed test, an
    error in `Rewards`) scores 0.0 with a logged error instead of failing the whole batch;
    only :class:`~posttrain.rewards.errors.SandboxUnavailableError` (configuration) raises.
    """
    if len(completions) != len(tests_list):
        raise ValueError(f"{len(completions)} completions but {len(tests_list)} test lists")
    workers = max(1, max_workers or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(code_reward, c, t, timeout_s, partial, mode=mode, limits=limits,
                               compare=compare)
                   for c, t in zip(completions, tests_list, strict=True)]
        return [_score_or_zero(future, index) for index, future in enumerate(futures)]


def _score_or_zero(future: Future, index: int) -> float:
    try:
        return future.result()
    except SandboxUnavailableError:
        raise
    except Exception as exc:  # one bad item must not sink the batch
        logger.error("code_rewards_batch: item %d scored 0.0: %r", index, exc)
        return 0.0
