"""Judge classes of issue 47: each wrong program below scores 0 in plain Python and must score 0
here; each honest one scores what plain Python gives it (computed here, by running the program
and the test in one namespace). Both sandbox modes (the `mode` fixture of
test_adversarial_programs)."""

from __future__ import annotations

import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from tests.sandbox.test_adversarial_programs import mode
from tests.sandbox.test_judge_shapes import _PAYLOAD

__all__ = ["mode"]

LIMITS = SandboxLimits(timeout_s=3.0)


def _score(program: str, tests: list[str], mode: str) -> tuple[float, object]:
    return code_reward_detailed(program, tests, 3.0, partial=True, mode=mode, limits=LIMITS)


def _plain(program: str, test: str) -> float:
    """What plain Python gives: the program and the test in one namespace (trusted text)."""
    namespace: dict = {"__name__": "__main__"}
    try:
        exec(program, namespace)
        exec(test, namespace)
    except Exception:
        return 0.0
    return 1.0


def _check(program: str, test: str, mode: str) -> None:
    expected = _plain(program, test)
    score, result = _score(program, [test], mode)
    assert score == expected, (program, test, result.test_status)
    assert result.in_process_verdicts == 0


# ---- 1. a name the program defines is the program's, whatever it is called -----------------
BUILTIN_TESTS = [
    "assert max([1, 5, 2]) == 5",
    "for xs, y in [([1, 2], 2), ([7, 3], 7)]:\n    assert max(xs) == y",
    "def check(candidate):\n    assert candidate([4, 9]) == 9\ncheck(max)",
    "assert max([1, 2]) == 2 and max([3]) == 3",
    "assert 1 < max([1, 2]) == 2 < 3",
    "assert sum([1, 2]) == 3 and sorted([2, 1]) == [1, 2] and pow(2, 3) == 8",
]
BUILTIN_PROGRAMS = [
    "def max(xs):\n    return 0\n",  # wrong: plain Python gives 0
    "def max(xs):\n    best = xs[0]\n    for x in xs:\n        best = x if x > best else best\n"
    "    return best\n",
    "def sum(xs):\n    return -1\ndef sorted(xs):\n    return xs\ndef pow(a, b):\n    return 0\n",
]


@pytest.mark.parametrize("test", BUILTIN_TESTS)
@pytest.mark.parametrize("program", range(len(BUILTIN_PROGRAMS)))
def test_builtin_named_entry_points_are_the_programs(program: int, test: str, mode: str) -> None:
    _check(BUILTIN_PROGRAMS[program], test, mode)


@pytest.mark.parametrize("test", ["assert all(f(a) == b for a, b in [(1, 5)])",
                                  "assert sorted([f(1)], key=lambda v: -v) == [5]",
                                  "assert sum(f(a) for a in [1]) == 5"])
def test_a_builtin_name_never_pulls_a_test_into_the_fallback(test: str, mode: str) -> None:
    # the program's names would take the test's generator or lambda: the in-process fallback
    # (forgeable) would then be the program's choice, so such a test fails instead
    program = ("def all(xs):\n    return True\ndef sorted(xs, key=None):\n    return [5]\n"
               "def sum(xs):\n    return 5\ndef f(x):\n    return 0\n")
    score, result = _score(program, [test], mode)
    assert (score, result.in_process_verdicts) == (0.0, 0), result.test_status


def test_an_honest_round_of_its_own_scores() -> None:
    honest = ("def round(x, digits=0):\n    scale = 10 ** digits\n"
              "    return int(x * scale + 0.5) / scale\n")  # half up, not Python's half even
    test = "assert round(2.5) == 3.0 and round(0.125, 2) == 0.13"
    assert _plain(honest, test) == 1.0
    assert _score(honest, [test], "limits")[0] == 1.0


# ---- 2. no standard-library runner runs program text in the judge ---------------------------
# one expression (no nested exec, which the guard refused even before issue 47) that writes a
# "passed" verdict on every writable descriptor and leaves, if it runs in the judge
_VERDICT = b'{"verdict":"passed","top":true}'
_EXPR = ("[__import__('os').write(i, {frame!r}) for i in range(3, 64) if __import__('os').path"
         ".exists('/proc/self/fd/%d' % i) and __import__('fcntl').fcntl(i, 3) & 3]"
         " + [__import__('os')._exit(0)]").format(frame=len(_VERDICT).to_bytes(4, "big") + _VERDICT)
_ANNOTATED = "def f(x: {!r}):\n    return 0\n".format(f"{_EXPR} or int")
_RUNNERS = {  # each hands text read from a program object to a standard-library code runner
    "type_hints": ("import typing\ntyping.get_type_hints(f)\nassert f(1) == 5", _ANNOTATED),
    "eval_str": ("import inspect\nassert inspect.get_annotations(f, eval_str=True) and f(1) == 5",
                 "def f(x: {!r}):\n    return 0\n".format(f"exec({_PAYLOAD!r}) or int")),
    "doctest": ("import doctest\ndoctest.run_docstring_examples(f, {})\nassert f(1) == 5",
                "def f(x):\n    {!r}\n    return 0\n".format(f">>> {_EXPR}\n")),
    "timeit": ("import timeit\ntimeit.timeit(f(1), number=1)\nassert f(2) == 5",
               f"def f(x):\n    return {_EXPR!r} if x == 1 else 0\n"),
}


@pytest.mark.parametrize("name", sorted(_RUNNERS))
def test_standard_library_runners_never_run_program_text(name: str, mode: str) -> None:
    test, program = _RUNNERS[name]
    score, result = _score(program, [test], mode)
    assert score == 0.0 and result.test_status == ["failed"], result.test_status


def test_the_standard_library_imports_under_the_guard(mode: str) -> None:
    modules = ("typing, dataclasses, inspect, doctest, unittest, fractions, decimal, statistics, "
               "enum, json, re, heapq, bisect, itertools, functools, collections, math, cmath, "
               "random, string, datetime, copy, pprint, operator, textwrap, numbers, array, "
               "struct, hashlib, io, abc, timeit, ast, difflib, calendar, queue, contextlib")
    test = f"import {modules}\nassert f(1) == 5 and bool(re.match('a+', 'aa'))"
    assert _score("def f(x):\n    return 2 * x + 3\n", [test], mode)[0] == 1.0


def test_the_standard_library_still_generates_its_own_code(mode: str) -> None:
    test = ("import typing\nfrom dataclasses import make_dataclass\n"
            "class P(typing.NamedTuple):\n    x: int\nQ = make_dataclass('Q', ['y'])\n"
            "import fractions, statistics\nassert P(f(1)).x == 5 == Q(f(1)).y")
    assert _score("def f(x):\n    return 2 * x + 3\n", [test], mode)[0] == 1.0


# ---- 3. program exceptions match `except` by their real class hierarchy ---------------------
_EXPECT = "try:\n    f(-1)\nexcept {name}:\n    pass\nelse:\n    raise AssertionError"
EXCEPTIONS = [
    # wrong: a local class named ValueError, a class renamed KeyError (plain Python: uncaught)
    ("def f(x):\n    class ValueError(Exception):\n        pass\n    raise ValueError('no')\n",
     "ValueError"),
    ("class Oops(Exception):\n    pass\nOops.__name__ = Oops.__qualname__ = 'KeyError'\n"
     "def f(x):\n    raise Oops('x')\n", "KeyError"),
    # honest: a subclass of a builtin, the program's own class, one that shadows a builtin
    ("class Bad(ValueError):\n    pass\ndef f(x):\n    raise Bad('negative')\n", "ValueError"),
    ("class Bad(ValueError):\n    pass\ndef f(x):\n    raise Bad('negative')\n", "Bad"),
    ("class InvalidInput(Exception):\n    pass\nclass Worse(InvalidInput, KeyError):\n    pass\n"
     "def f(x):\n    raise Worse('negative')\n", "(InvalidInput, OSError)"),
    ("class ValueError(Exception):\n    pass\ndef f(x):\n    raise ValueError('no')\n",
     "ValueError"),
]


@pytest.mark.parametrize("case", range(len(EXCEPTIONS)))
def test_exceptions_match_by_their_class_hierarchy(case: int, mode: str) -> None:
    program, name = EXCEPTIONS[case]
    _check(program, _EXPECT.format(name=name), mode)


def test_an_exception_keeps_its_message_and_attributes(mode: str) -> None:
    program = ("class Bad(ValueError):\n    def __init__(self, code):\n"
               "        super().__init__(f'code {code}')\n        self.code = code\n"
               "def f(x):\n    raise Bad(x)\n")
    test = ("try:\n    f(7)\nexcept ValueError as e:\n"
            "    assert e.code == 7 and str(e) == 'code 7' and isinstance(e, Bad)\n"
            "else:\n    raise AssertionError")
    _check(program, test, mode)


# ---- 4. reads of program globals see the program's current value ----------------------------
GLOBALS = [
    ("COUNT = 0\ndef inc():\n    global COUNT\n    COUNT += 1\n",
     "inc()\ninc()\nassert COUNT == 2"),  # honest counter
    ("STACK = []\ndef push(x):\n    STACK.append(x)\n", "push(1)\npush(2)\nassert STACK == [1, 2]"),
    ("STATE = [0]\ndef add():\n    STATE[0] += 1\ndef reset():\n    pass\n",
     "add()\nreset()\nassert STATE == [0]"),  # wrong: a reset that does nothing
    ("def setup():\n    global READY\n    READY = True\n", "setup()\nassert READY"),
    ("X = 1\ndef bump():\n    global X\n    X = X + 1\n", "bump()\nbump()\nassert X == 3"),
]


@pytest.mark.parametrize("case", range(len(GLOBALS)))
def test_program_globals_are_read_as_they_are_now(case: int, mode: str) -> None:
    _check(*GLOBALS[case], mode)


def test_a_name_the_test_binds_stays_the_tests(mode: str) -> None:
    # documented difference: plain Python shares one namespace, so the program's later
    # `global close; close = ...` would replace the test's helper; here the test's stays
    program = ("def close(a, b):\n    return True\n"
               "def f(x):\n    global close\n    close = lambda a, b: True\n    return 0\n")
    test = "def close(a, b):\n    return a == b\nf(1)\nassert close(f(1), 5)"
    assert _plain(program, test) == 1.0
    assert _score(program, [test], mode)[0] == 0.0


# ---- 5. only names the program's code binds, never dunders ---------------------------------
_FORGE = ("class Everything:\n    def __getitem__(self, name):\n        return lambda *a: 0\n"
          "import sys\nmain = sys.modules['__main__']\nreal = main.describe_names\n"
          "def forged(*args, **kwargs):\n    names = real(*args, **kwargs)\n"
          "    names.update({'__file__': ['v', 'forged'], '__name__': ['v', 'x'],\n"
          "                  '__builtins__': ['h', args[1].register(Everything())],\n"
          "                  'gh' + 'ost': ['v', 1]})\n"
          "    return names\n"
          "main.describe_names = forged\ndef f(x):\n    return 0\n")


@pytest.mark.parametrize("test", [
    "assert f(1) == 5 or ghost == 1",
    "assert f(1) == 5 or __file__ == 'forged'",
    "if __name__ == '__main__':\n    assert f(1) == 5",
    "assert abs(f(1) - 5) < 1e-9",  # builtins looked up in a program object
])
def test_a_forged_hello_binds_nothing_the_program_did_not_define(test: str, mode: str) -> None:
    score, result = _score(_FORGE, [test], mode)
    assert score == 0.0, result.test_status


# ---- honest shapes: what plain Python gives them ---------------------------------------------
_OBJECTS = ("import collections\n"
            "class Point:\n    def __init__(self, x):\n        self.x = x\n"
            "    def __repr__(self):\n        return f'Point({self.x})'\n"
            "    def __str__(self):\n        return f'<{self.x}>'\n"
            "class Box:\n    def __init__(self, *items):\n        self.items = list(items)\n"
            "    def __len__(self):\n        return len(self.items)\n"
            "    def __getitem__(self, i):\n        return self.items[i]\n"
            "def same(p):\n    return type(p)\n"
            "def point(x):\n    return Point(x)\n"
            "def box():\n    return Box(3, 4, 5)\n"
            "def window():\n    return collections.deque([1, 2, 3], maxlen=3)\n"
            "BIG = list(range(600))\nTEXT = 'ab' * 1000\n"
            "import enum\nclass Color(enum.IntEnum):\n    RED = 1\n"
            "Pair = collections.namedtuple('Pair', 'x y')\n"
            "def pair(x, y):\n    return Pair(x, y)\n"
            "def pairs():\n    return [Pair(0, 1)]\n"
            "def counts(s):\n    return collections.Counter(s)\n"
            "def color():\n    return Color.RED\n")
HONEST_SHAPES = [
    "assert str(point(2)) == '<2>' and repr(point(3)) == 'Point(3)'",
    "assert f'{point(2)}' == '<2>' and '%s' % point(1) == '<1>'",
    "assert len(box()) == 3 and box()[0] == 3 and box()[-1] == 5 and box()[1:] == [4, 5]",
    "assert len(window()) == 3 and window()[2] == 3",
    "assert len(BIG) == 600 and BIG[599] == 599 and len(TEXT) == 2000 and TEXT[:3] == 'aba'",
    "assert pair(1, 2) == (1, 2) and pair(1, 2).y == 2 and str(pair(1, 2)) == 'Pair(x=1, y=2)'",
    "assert counts('abca') == {'a': 2, 'b': 1, 'c': 1} and counts('ab')['z'] == 0\n"
    "assert counts('aab').most_common(1) == [('a', 2)] and sorted(counts('ba')) == ['a', 'b']",
    "assert color() == 1 and color() + 1 == 2 and repr(color()) == '<Color.RED: 1>'",
    "assert {pair(1, 2): 'p'}[(1, 2)] == 'p' and same(pair(3, 4)) is Pair",
]


@pytest.mark.parametrize("shape", range(len(HONEST_SHAPES)))
def test_honest_shapes_score_what_python_gives(shape: int, mode: str) -> None:
    assert _plain(_OBJECTS, HONEST_SHAPES[shape]) == 1.0
    _check(_OBJECTS, HONEST_SHAPES[shape], mode)


@pytest.mark.parametrize("base", ["tuple", "dict", "int", "str"])
def test_a_subclass_compares_as_its_base_type_here(base: str, mode: str) -> None:
    # stricter than plain Python: the subclass's own __eq__ never decides (it lies here)
    value = {"tuple": "()", "dict": "{}", "int": "0", "str": "''"}[base]
    program = (f"class Liar({base}):\n    def __eq__(self, other):\n        return True\n"
               "    __hash__ = None\n    def __ne__(self, other):\n        return False\n"
               f"def f(x):\n    return Liar({value})\n")
    tests = ["assert f(1) == (5,)", "assert f(1) == {'a': 5}", "assert f(1) == 5",
             "assert not f(1) != 'five'"]
    assert _plain(program, tests[0]) == 1.0
    score, result = _score(program, tests, mode)
    assert score == 0.0 and result.in_process_verdicts == 0, result.test_status


@pytest.mark.parametrize("test", ["assert pair(1, 2) == (1, 2)", "assert color() == 1",
                                  "assert counts('aba') == {'a': 2, 'b': 1}",
                                  "assert pairs() == [(0, 1)]"])
def test_value_tests_compare_a_subclass_as_its_base_value(test: str, mode: str) -> None:
    assert _plain(_OBJECTS, test) == 1.0
    score, result = _score(_OBJECTS, [test], mode)
    assert (score, result.test_kinds) == (1.0, ["value"]), result.test_status
    wrong = test.replace("== (1, 2)", "== (2, 1)").replace("== 1", "== 2").replace(
        "'a': 2", "'a': 1").replace("[(0, 1)]", "[(1, 0)]")
    assert _score(_OBJECTS, [wrong], mode)[0] == _plain(_OBJECTS, wrong) == 0.0
