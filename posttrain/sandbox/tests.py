"""Test formats of the code reward and how each one is judged (docs/sandbox.md).

* ``value``: ``assert name(<literals>) == <literal>``: the program's process answers that one
  call in wire form (:mod:`.wire`), compared here, outside the sandbox, type-strictly.
* ``stdio``: ``{"input": str, "output": str}``: the program runs as a script with ``input`` on
  stdin; its stdout is compared here with ``output`` (never sent to the sandbox).
* ``assert``: any other snippet; it runs in a judge process of its own (:mod:`.judge`) where
  the program's names are proxies returning plain data; the verdict is the judge's. A test
  that needs what a proxy cannot carry falls back to the program's interpreter and is counted
  (``code/in_process_verdicts``).

Comparison (:class:`CompareOptions`): exact, and stricter than ``==``: ``True`` is not ``1``,
``5.0`` is not ``5`` unless ``bool_int`` / ``int_float`` say so.
More: docs/sandbox.md, "Module notes", posttrain.sandbox.tests.
"""

from __future__ import annotations

import ast
import json
import math
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from posttrain.data.schemas import stdio_problem
from posttrain.sandbox.wire import WireError, loads_strict, wire_decode, wire_encode

KINDS = ("value", "stdio", "assert")
STDOUT_MATCH = ("exact", "rstrip", "tokens")
_SCALARS = (type(None), bool, int, float, str)
_MAX_DEPTH = 100  # deeper plain data is refused (the literal parser's own limit is ~200)
_MAX_CALL_BYTES = 16384  # a value test's arguments larger than this go to the judge instead
# CPython 3.11's AST <-> Python object conversion keeps its recursion depth in shared state:
# `ast.parse` / `compile(<ast>)` / `ast.unparse` from two threads at once (the reward pool's
# workers) can fail with "SystemError: AST constructor recursion depth mismatch"
AST_LOCK = threading.Lock()
_ASCII_SPACE = re.compile(r"[ \t\n\r\x0b\x0c]+")


@dataclass(frozen=True)
class CodeTest:
    """One test. ``kind``: see the module docstring.

    ``source``: the snippet (``assert``), the prelude (``value``) or the stdin text (``stdio``);
    ``expr``: the expression whose value is checked (``value``); ``expected``: the literal's
    value (``value``) or the expected stdout (``stdio``) - it never enters the sandbox.
    """

    kind: str
    source: str
    expr: str = ""
    expected: Any = None
    args: tuple[Any, ...] = ()
    """``value``: the call's ``(positional, keyword)`` arguments in wire form (:mod:`.wire`)."""

    def sandbox_message(self, index: int) -> dict[str, Any]:
        """What the supervisor receives for this test: never ``expected``, and for an assert
        test not even its source (that goes to the judge process alone, see
        :func:`posttrain.sandbox.jail.run_sandboxed`)."""
        if self.kind == "value":
            return {"kind": "value", "prelude": self.source, "name": self.expr,
                    "args": self.args[0], "kwargs": self.args[1]}
        if self.kind == "stdio":
            return {"kind": "stdio", "input": self.source}
        return {"kind": "assert", "index": index}


@dataclass(frozen=True)
class CompareOptions:
    """How values and stdout are compared (defaults in brackets; docs/sandbox.md)."""

    float_rel_tol: float = 0.0
    """Relative tolerance for floats (``math.isclose``) [0: exact]."""
    float_abs_tol: float = 0.0
    """Absolute tolerance for floats [0: exact]."""
    int_float: bool = False
    """An ``int`` and a ``float`` of equal value match (``5.0`` vs ``5``) [False]."""
    bool_int: bool = False
    """A ``bool`` and an ``int`` of equal value match (``True`` vs ``1``) [False]."""
    stdout: str = "rstrip"
    """stdin/stdout tests: ``exact``; ``rstrip`` (trailing whitespace of each line and trailing
    blank lines ignored); ``tokens`` (whitespace-separated tokens equal) [rstrip]."""

    def __post_init__(self) -> None:
        for name in ("float_rel_tol", "float_abs_tol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"CompareOptions.{name} must be a number >= 0, got {value!r}")
        if self.stdout not in STDOUT_MATCH:
            raise ValueError(f"CompareOptions.stdout must be one of {list(STDOUT_MATCH)}, "
                             f"got {self.stdout!r}")

    @classmethod
    def from_any(cls, value: CompareOptions | Mapping[str, Any] | None) -> CompareOptions:
        """Accept an instance, a dict from a recipe (unknown keys are an error) or None."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"compare must be a dict or CompareOptions, got {type(value)!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown compare option(s) {unknown}; valid: {sorted(known)}")
        return cls(**value)


def is_plain(value: Any, depth: int = 0) -> bool:
    """True for plain data of exact types (no subclasses), nested at most ``_MAX_DEPTH``."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if depth >= _MAX_DEPTH:
        return False
    if kind is list or kind is tuple:
        return all(is_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(type(k) in _SCALARS or (type(k) is tuple and is_plain(k, depth + 1))
                   for k in value) and all(is_plain(v, depth + 1) for v in value.values())
    return False


def is_finite(value: Any) -> bool:
    """False if plain data ``value`` holds a non-finite float anywhere (they never match)."""
    if type(value) is float:
        return math.isfinite(value)
    if type(value) in (list, tuple):
        return all(is_finite(item) for item in value)
    if type(value) is dict:
        return all(is_finite(k) and is_finite(v) for k, v in value.items())
    return True


_OPAQUE = object()


def _opaque(number: int, *view: Any) -> object:
    """A program object the value path cannot compare (it fails the test); an instance of a
    subclass of a plain type (``["x", n, base, overrides]``) compares as its base value, read
    with the base type's own methods, unless its class redefines ``==`` or hashing (Python
    would run those; the expected value never reaches the program, so the test fails)."""
    if not view or {"__eq__", "__hash__"} & view[1]:
        return _OPAQUE
    return view[0]


def decode_value(text: str) -> tuple[bool, Any]:
    """Parse a value sent by the sandbox (the wire form of plain data, :mod:`.wire`);
    ``(False, None)`` if it is not plain data with finite floats. Raises
    :class:`~posttrain.sandbox.io.ProtocolError` if it is not the wire form at all."""
    from posttrain.sandbox.io import ProtocolError

    try:
        value = wire_decode(loads_strict(text.encode(), top_object=False), _opaque,
                            in_order=False)
    except (WireError, RecursionError, MemoryError) as exc:
        raise ProtocolError(f"a value that is not in wire form: {exc}") from None
    return (True, value) if is_plain(value) and is_finite(value) else (False, None)


def _float_equal(got: float | int, expected: float | int, options: CompareOptions) -> bool:
    """Exact unless a tolerance is set; an int too large for a float compares exactly."""
    if not all(math.isfinite(x) for x in (got, expected) if type(x) is float):
        return False
    if options.float_rel_tol or options.float_abs_tol:
        try:
            return math.isclose(float(got), float(expected), rel_tol=options.float_rel_tol,
                                abs_tol=options.float_abs_tol)
        except OverflowError:
            pass
    return bool(got == expected)  # int == float is exact in Python, at any size


def _scalar_equal(got: Any, expected: Any, options: CompareOptions) -> bool:
    types = {type(got), type(expected)}
    if len(types) > 1:
        numeric = types <= {int, float} and options.int_float
        boolean = types <= {bool, int} and options.bool_int
        if not (numeric or boolean):
            return False
    if float in types:
        return _float_equal(got, expected, options)
    return bool(got == expected)


def values_equal(got: Any, expected: Any, options: CompareOptions | None = None) -> bool:
    """Type-strict equality of two plain values (see :class:`CompareOptions`)."""
    options = options or CompareOptions()
    if type(got) in _SCALARS and type(expected) in _SCALARS:
        return _scalar_equal(got, expected, options)
    if type(got) is not type(expected):
        return False
    if type(got) in (list, tuple):
        return len(got) == len(expected) and all(
            values_equal(g, e, options) for g, e in zip(got, expected, strict=True))
    if type(got) is dict:
        if len(got) != len(expected):
            return False
        keys = {k: k for k in got}  # the key object of `got` that Python's lookup matches
        for key, value in expected.items():
            if key not in keys or type(keys[key]) is not type(key) or keys[key] != key:
                return False
            if not values_equal(got[keys[key]], value, options):
                return False
        return True
    return False


def stdout_equal(got: str, expected: str, mode: str = "rstrip") -> bool:
    """Compare a program's stdout with the expected output (``CompareOptions.stdout``)."""
    if mode == "exact":
        return got == expected
    if mode == "tokens":
        return _tokens(got) == _tokens(expected)
    return _rstrip_lines(got) == _rstrip_lines(expected)


def _tokens(text: str) -> list[str]:
    """Tokens between runs of ASCII whitespace (not ``str.split``'s \\x1c-\\x1f and others)."""
    return [token for token in _ASCII_SPACE.split(text) if token]


def _rstrip_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _literal(node: ast.expr) -> tuple[bool, Any]:
    """``(True, value)`` of a literal; a set display in it is built as the test's compiled
    code builds it (``literal_eval`` adds items one at a time: another order, and the program
    gets the set in the order sent)."""
    try:
        value = ast.literal_eval(node)
        if any(isinstance(part, ast.Set) for part in ast.walk(node)):  # only literals: safe
            code = compile(ast.fix_missing_locations(ast.Expression(node)), "<test>", "eval")
            value = eval(code, {"__builtins__": {"set": set}})  # noqa: S307
        return True, value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, NameError):
        return False, None


def _call_arguments(call: ast.expr, bound: set[str]) -> tuple[str, tuple[Any, Any]] | None:
    """``(name, wire arguments)`` of ``name(<literals>)`` when ``name`` is not bound by the
    prelude, else None (then the test goes to the judge)."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or \
            call.func.id in bound:
        return None
    if any(isinstance(a, ast.Starred) for a in call.args) or \
            any(k.arg is None for k in call.keywords):
        return None
    values = [_literal(node) for node in [*call.args, *(k.value for k in call.keywords)]]
    if not all(ok for ok, _ in values):
        return None
    try:
        positional = [wire_encode(v) for _, v in values[:len(call.args)]]
        keywords = [[k.arg, wire_encode(v)] for k, (_, v) in
                    zip(call.keywords, values[len(call.args):], strict=True)]
    except (WireError, RecursionError):
        return None
    if len(json.dumps([positional, keywords])) > _MAX_CALL_BYTES:
        return None
    return call.func.id, (positional, keywords)


def _value_test(module: ast.Module) -> CodeTest | None:
    """The ``value`` form of an assert snippet, or None when it is not of that shape.

    Sound only when nothing but the program's own function runs in its process: the snippet
    is ``[imports...] assert name(<literals>) == <literal>`` (either order, optional message),
    ``name`` not bound by the imports, the expected literal plain data with finite floats.
    Everything else (a comparison inside the expression, a helper, a prelude statement that
    is not an import) is judged by the judge process.
    """
    if not module.body or not isinstance(module.body[-1], ast.Assert):
        return None
    prelude = module.body[:-1]
    if not all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in prelude):
        return None
    bound = {(alias.asname or alias.name).split(".")[0] for node in prelude
             for alias in node.names}  # type: ignore[attr-defined]
    check = module.body[-1].test
    if not (isinstance(check, ast.Compare) and len(check.ops) == 1
            and isinstance(check.ops[0], ast.Eq)):
        return None
    left, right = check.left, check.comparators[0]
    for expr, literal in ((left, right), (right, left)):
        ok, expected = _literal(literal)
        if not (ok and is_plain(expected) and is_finite(expected)):
            continue
        call = _call_arguments(expr, bound)
        if call is not None:
            prelude_source = ast.unparse(ast.Module(body=prelude, type_ignores=[]))
            return CodeTest("value", prelude_source, expr=call[0], expected=expected,
                            args=call[1])
    return None


def parse_test(item: Any, index: int = 0) -> CodeTest:
    """One test of a row (a snippet or a stdin/stdout dict); ValueError on anything else."""
    with AST_LOCK:
        return _parse_test(item, index)


def _parse_test(item: Any, index: int) -> CodeTest:
    if isinstance(item, CodeTest):
        return item
    if isinstance(item, dict):
        problem = stdio_problem(item)
        if problem:
            raise ValueError(f"test {index}: {problem}")
        return CodeTest("stdio", item["input"], expected=item["output"])
    if not isinstance(item, str):
        raise ValueError(f"test {index}: expected a string (assert snippet) or an "
                         f"{{'input': str, 'output': str}} object, got {type(item).__name__}")
    try:
        module = ast.parse(item)
        compile(module, f"<test {index}>", "exec")
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"test {index} does not compile: {exc}: {item[:200]!r}") from exc
    return _value_test(module) or CodeTest("assert", item)


FAILURES = ("failed", "timeout", "memory", "crashed", "sandbox_error")
_SUCCESS = {"assert": "passed", "value": "returned", "stdio": "exited"}


def judge(test: CodeTest, response: Mapping[str, Any], options: CompareOptions) -> str:
    """Status of one test from the sandbox's answer, decided here (outside the sandbox).

    ``response`` is an answer of the supervisor (``harness``): a failure status is taken as
    it is (a program can only lose by lying about failing); for ``value`` and ``stdio`` tests
    success only means "finished", and the comparison with the expected value or output,
    which the sandbox never had, decides. A status that the test's kind cannot produce raises
    :class:`~posttrain.sandbox.io.ProtocolError` (the run becomes ``sandbox_error``).
    """
    from posttrain.sandbox.io import ProtocolError

    status = response["status"]
    if status in FAILURES:
        return status
    if status != _SUCCESS[test.kind]:
        raise ProtocolError(f"status {status!r} is not an answer to a {test.kind} test")
    if test.kind == "assert":
        return "passed"
    if test.kind == "value":
        if not isinstance(response["value"], str):
            raise ProtocolError("a returned value test carries no value")
        ok, value = decode_value(response["value"])
        return "passed" if ok and values_equal(value, test.expected, options) else "failed"
    if not isinstance(response["stdout"], str):
        raise ProtocolError("an exited stdin/stdout test carries no stdout")
    if response["truncated"]:
        return "failed"
    return "passed" if stdout_equal(response["stdout"], test.expected, options.stdout) \
        else "failed"
