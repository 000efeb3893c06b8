"""Code reward (formulas §10): run the completion's program against unit tests in a sandbox.

``code_reward(completion, tests)`` returns 1.0 when every test passes (``partial=True``: the
fraction that passed). Timeouts, crashes, memory blow-ups, early exits and any misbehaviour
score 0 for the tests they affect. The program is the last fenced python block of the
completion (```` ```python ````, ```` ```py ```` or a bare ```` ``` ```` fence), else the whole
completion.

Tests: a list (one test each) of assert snippets or stdin/stdout dicts
``{"input": str, "output": str}``, or one string. A string is split with ``ast``: each
top-level ``assert`` statement is one test, and every other top-level statement (imports,
helpers, ``x = f(3)``) is a shared prelude run before each assert; a string without top-level
asserts (e.g. HumanEval's ``def check(candidate): ...`` followed by ``check(f)``) is one test.
A test of any other type or shape is a ``ValueError``, never a pass.

Each test runs in its own fresh process: the program, then that test. How a test is judged
depends on its shape (:mod:`posttrain.rewards.code_tests`, docs/sandbox.md): ``assert <expr>
== <literal>`` and stdin/stdout tests are compared outside the sandbox, type-strictly, with the
expected value the sandbox never sees (``compare`` options); any other assert is judged inside
the program's interpreter (counted as ``code/in_process_verdicts``). Never by what it prints.
``timeout_s`` bounds each test (wall clock and CPU); with ``partial=False`` the run stops at the
first failing test, so a stuck program costs about one ``timeout_s``.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from posttrain.rewards.code_tests import CompareOptions, parse_test
from posttrain.rewards.sandbox import SandboxLimits, SandboxResult, run_sandboxed

Compare = CompareOptions | Mapping[str, Any] | None

_FENCE_RE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(completion: str) -> str:
    """The last fenced python (or unlabelled) code block, else the whole completion."""
    blocks = [body for _, body in _FENCE_RE.findall(completion)]
    return blocks[-1] if blocks else completion


def split_tests(tests: str | Sequence[str | dict]) -> list[str | dict]:
    """One snippet (or stdin/stdout dict) per test (see the module docstring). Raises ValueError
    on a test that does not compile or has an unknown shape - a dataset error, not the
    policy's."""
    if isinstance(tests, str):
        try:
            module = ast.parse(tests)
        except SyntaxError as exc:
            raise ValueError(f"tests do not compile: {exc}") from exc
        asserts = [node for node in module.body if isinstance(node, ast.Assert)]
        if asserts:
            prelude = "\n".join(ast.get_source_segment(tests, node) or ""
                                for node in module.body if not isinstance(node, ast.Assert))
            snippets = [prelude + "\n" + (ast.get_source_segment(tests, node) or "")
                        for node in asserts]
        else:
            snippets = [tests]
    elif isinstance(tests, (list, tuple)):
        snippets = list(tests)
    else:
        raise ValueError(f"tests must be a string or a list, got {type(tests).__name__}")
    if not snippets:
        raise ValueError("no tests given: a code task needs at least one test")
    for index, snippet in enumerate(snippets):
        parse_test(snippet, index)  # raises on a bad snippet or an unknown shape
    return snippets


def code_reward_detailed(completion: str, tests: str | Sequence[str | dict],
                         timeout_s: float = 5.0, partial: bool = False, *, mode: str = "auto",
                         limits: SandboxLimits | None = None, compare: Compare = None
                         ) -> tuple[float, SandboxResult]:
    """``code_reward`` plus the sandbox result (status for the per-reason counters)."""
    snippets = split_tests(tests)
    limits = replace(limits or SandboxLimits(), timeout_s=timeout_s)
    result = run_sandboxed(extract_program(completion), snippets, limits=limits, mode=mode,
                           stop_on_failure=not partial, compare=compare)
    if partial:
        return result.tests_passed / result.tests_total, result
    return (1.0 if result.status == "passed" else 0.0), result


def code_reward(completion: str, tests: str | list[str | dict], timeout_s: float = 5.0,
                partial: bool = False, *, mode: str = "auto",
                limits: SandboxLimits | None = None, compare: Compare = None) -> float:
    """1.0 if the program passes every test (``partial``: fraction passed), else 0.0.

    ``mode``: sandbox mode (``auto`` | ``bwrap`` | ``strict`` | ``limits``, docs/sandbox.md);
    ``limits``: resource limits (their ``timeout_s`` is replaced by this ``timeout_s``);
    ``compare``: :class:`~posttrain.rewards.code_tests.CompareOptions` or a dict of them
    (float tolerance, ``int_float``, ``bool_int``, stdout matching).
    """
    return code_reward_detailed(completion, tests, timeout_s, partial, mode=mode,
                                limits=limits, compare=compare)[0]


def code_rewards_batch(completions: Sequence[str],
                       tests_list: Sequence[str | Sequence[str | dict]],
                       timeout_s: float = 5.0, partial: bool = False, *, mode: str = "auto",
                       limits: SandboxLimits | None = None, max_workers: int | None = None,
                       compare: Compare = None) -> list[float]:
    """``code_reward`` over many completions with a bounded pool (default: one per core).

    Each run is bounded by its own deadline, so the batch never waits on one stuck program for
    longer than that program's limit.
    """
    if len(completions) != len(tests_list):
        raise ValueError(f"{len(completions)} completions but {len(tests_list)} test lists")
    workers = max(1, max_workers or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(code_reward, c, t, timeout_s, partial, mode=mode, limits=limits,
                               compare=compare)
                   for c, t in zip(completions, tests_list, strict=True)]
        return [future.result() for future in futures]
