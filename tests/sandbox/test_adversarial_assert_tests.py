"""Adversarial programs against assert tests judged in the judge process (issue 23).

Every lying program below is run, with partial credit, against the same three checks
(`f(1) == 5`, `f(2) == 7`, `f(3) == 9`) written in each test shape the issue lists, so a single
forged pass shows as a score above 0; the honest program keeps 1.0 in every shape, with no
in-process verdict. Both sandbox modes (the `mode` fixture of test_adversarial_programs).
"""

from __future__ import annotations

import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from tests.sandbox.test_adversarial_programs import (
    _own_children,
    mode,
)

__all__ = ["mode"]

LIMITS = SandboxLimits(timeout_s=2.0)
HONEST = "def f(x):\n    return 2 * x + 3\n"
CHECKS = [(1, 5), (2, 7), (3, 9)]

# each shape: (prelude, assert) with {x} and {y}; the 17 and a few more
SHAPES = {
    "eq_is_true": ("", "assert (f({x}) == {y}) == True"),
    "difference_is_zero": ("", "assert f({x}) - {y} == 0"),
    "bool_of_eq": ("", "assert bool(f({x}) == {y}) == True"),
    "all_generator": ("", "assert all(f(a) == b for a, b in [({x}, {y})]) == True"),
    "sum_of_eq": ("", "assert sum([f({x}) == {y}]) == 1"),
    "str_of_eq": ("", "assert str(f({x}) == {y}) == 'True'"),
    "operator_eq": ("import operator", "assert operator.eq(f({x}), {y}) == True"),
    "helper_close": ("def close(a, b):\n    return abs(a - b) < 1e-9",
                     "assert close(f({x}), {y}) == True"),
    "prelude_flag": ("ok1 = f({x}) == {y}", "assert ok1 == True"),
    "math_isclose": ("import math", "assert math.isclose(f({x}), {y}) == True"),
    "prelude_raise": ("if f({x}) != {y}:\n    raise AssertionError('no')", "assert True"),
    "abs_tolerance": ("", "assert abs(f({x}) - {y}) < 1e-9"),
    "not_ne": ("", "assert not f({x}) != {y}"),
    "in_list": ("", "assert f({x}) in [{y}]"),
    "wrapped_list": ("", "assert [f({x})] == [{y}]"),
    "eq_and_true": ("", "assert f({x}) == {y} and True"),
    "isclose_imported": ("from math import isclose", "assert isclose(f({x}), {y})"),
    "humaneval_check": ("def check(candidate):\n    assert candidate({x}) == {y}",
                        "check(f)"),
    "int_of_value": ("", "assert int(f({x})) == {y}"),
    "sorted_of_list": ("", "assert sorted([f({x})]) == [{y}]"),
}

_LIAR = ("class A:\n"
         "    def __eq__(self, o):\n        return True\n"
         "    def __ne__(self, o):\n        return False\n"
         "    __hash__ = object.__hash__\n"
         "    def __bool__(self):\n        return True\n"
         "    def __sub__(self, o):\n        return 0\n"
         "    __rsub__ = __sub__\n"
         "    def __abs__(self):\n        return 0\n"
         "    def __lt__(self, o):\n        return True\n"
         "    __le__ = __gt__ = __ge__ = __lt__\n"
         "    def __str__(self):\n        return 'True'\n"
         "    def __int__(self):\n        return 5\n"
         "    def __float__(self):\n        return 5.0\n"
         "    def __index__(self):\n        return 5\n")
LYING_PROGRAMS = {
    "always_equal_object": _LIAR + "def f(x):\n    return A()\n",
    "int_subclass": "class I(int):\n    __hash__ = int.__hash__\n"
                    "    def __eq__(self, o):\n        return True\n"
                    "    def __ne__(self, o):\n        return False\n"
                    "    def __sub__(self, o):\n        return 0\n"
                    "def f(x):\n    return I(0)\n",
    "patched_builtins": "import builtins\n"
                        "builtins.abs = lambda v: 0\nbuiltins.all = lambda v: True\n"
                        "builtins.bool = lambda v=0: True\nbuiltins.str = lambda v='': 'True'\n"
                        "builtins.sum = lambda v, s=0: 1\nbuiltins.int = lambda v=0: 5\n"
                        "builtins.sorted = lambda v: [5, 7, 9]\n"
                        "def f(x):\n    return 0\n",
    "patched_stdlib": "import math, operator\n"
                      "math.isclose = lambda *a, **k: True\noperator.eq = lambda a, b: True\n"
                      "def f(x):\n    return 0\n",
    "shadowing_names": "import math\n"  # names the test defines or imports itself
                       "def isclose(*a, **k):\n    return True\n"
                       "def close(a, b):\n    return True\ncheck = lambda candidate: None\n"
                       "ok1 = True\nAssertionError = None\n"
                       "def f(x):\n    return 0\n",
    "lying_module_attribute": "import math\nmath.isclose = lambda *a, **k: True\n"
                              "from math import isclose\ndef f(x):\n    return 0\n",
    "frames_patch_judge_locals": "import sys\n"
                                 "def f(x):\n"
                                 "    frame = sys._getframe(1)\n"
                                 "    while frame is not None:\n"
                                 "        frame.f_globals['abs'] = lambda v: 0\n"
                                 "        frame = frame.f_back\n"
                                 "    return 0\n",
    "exit_clean_inside_call": "import os\ndef f(x):\n    os._exit(0)\n",
    "system_exit_zero": "def f(x):\n    raise SystemExit(0)\n",
    "raises_assertion_subclass": "def f(x):\n    raise KeyboardInterrupt\n",
}


def _tests(shape: str) -> list[str]:
    prelude, check = SHAPES[shape]
    return [((prelude + "\n" if prelude else "") + check).format(x=x, y=y) for x, y in CHECKS]


def _score(program: str, tests: list[str], mode: str) -> tuple[float, object]:
    score, result = code_reward_detailed(program, tests, LIMITS.timeout_s, True, mode=mode,
                                         limits=LIMITS)
    assert result.mode == mode
    assert _own_children() == []
    return score, result


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_is_judged_outside_and_honest_scores_hold(shape: str, mode: str) -> None:
    score, result = _score(HONEST, _tests(shape), mode)
    assert (score, result.status) == (1.0, "passed"), result.detail
    assert result.in_process_verdicts == 0 and result.test_kinds == ["assert"] * 3
    half = "def f(x):\n    return 5 if x == 1 else 0\n"  # right on the first check only
    assert _score(half, _tests(shape), mode)[0] == pytest.approx(1 / 3)


@pytest.mark.parametrize("liar", sorted(LYING_PROGRAMS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_lying_programs_score_zero_in_every_shape(shape: str, liar: str, mode: str) -> None:
    score, result = _score(LYING_PROGRAMS[liar], _tests(shape), mode)
    assert score == 0.0, (result.test_status, result.detail)
    assert result.in_process_verdicts == 0


# names the program binds that shadow a builtin the test calls are the program's, as in plain
# Python (issue 47): the score is plain Python's in every shape, never more
SHADOWING_BUILTINS = ("def abs(v):\n    return 0\ndef all(v):\n    return True\n"
                      "def bool(v):\n    return True\ndef f(x):\n    return 0\n")


def _plain_score(program: str, tests: list[str]) -> float:
    passed = 0
    for test in tests:
        namespace: dict = {"__name__": "__main__"}
        try:
            exec(program, namespace)
            exec(test, namespace)
            passed += 1
        except Exception:
            pass
    return passed / len(tests)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_names_shadowing_builtins_score_what_plain_python_gives(shape: str, mode: str) -> None:
    # but a generator the test built never reaches the program's `all`: that would make the
    # program choose the (forgeable) in-process fallback, so the test fails instead
    expected = 0.0 if shape == "all_generator" else _plain_score(SHADOWING_BUILTINS, _tests(shape))
    score, result = _score(SHADOWING_BUILTINS, _tests(shape), mode)
    assert score == expected, (result.test_status, result.detail)
    assert result.in_process_verdicts == 0


# ---- the protocol: exactly one framed answer per request, or the test is lost -------------
_SOCKETS = ("import json, os, stat, struct\n"
            "def frame(obj):\n"
            "    data = json.dumps(obj).encode()\n"
            "    return struct.pack('>I', len(data)) + data\n"
            "def fds():\n"
            "    for fd in range(3, 64):\n"
            "        try:\n"
            "            os.fstat(fd)\n"
            "            yield fd\n"
            "        except OSError:\n"
            "            pass\n"
            "def spray(data):\n"
            "    for fd in fds():\n"
            "        try:\n"
            "            os.write(fd, data)\n"
            "        except OSError:\n"
            "            pass\n")
PROTOCOL_ATTACKS = {
    "forged_hello_and_answers_at_top": _SOCKETS + (
        "spray(frame({'names': {}}) + b''.join(frame({'id': i, 'ok': True, 'back': [None]})\n"
        "      for i in range(1, 9)))\n"
        "def f(x):\n    return 0\n"),
    "answer_before_the_real_one": _SOCKETS + (  # the forged answer is read; the real one is
        "def f(x):\n"  # left over, and the judge's last request finds it
        "    spray(frame({'id': 1, 'ok': True, 'back': [None]}))\n"
        "    return 0\n"),
    "answers_for_later_ids": _SOCKETS + (
        "def f(x):\n"
        "    spray(b''.join(frame({'id': i, 'ok': True, 'back': [None]}) for i in range(2, 9)))\n"
        "    return 0\n"),
    "answer_then_exit": _SOCKETS + (
        "def f(x):\n"
        "    spray(frame({'id': 1, 'ok': True, 'back': [None]}))\n"
        "    os._exit(0)\n"),
    "oversized_frame_header": _SOCKETS + (
        "def f(x):\n    spray(struct.pack('>I', 1 << 31))\n    return 0\n"),
    "trailing_comment_bytes": _SOCKETS + (  # issue 23: `#` turned the real value into a comment
        "def f(x):\n    spray(b'UV' + str(2 * x + 3).encode() + b'#')\n    return 0\n"),
    "nan_and_float_tokens": _SOCKETS + (
        "def f(x):\n    spray(b'\\x00\\x00\\x00\\x1a{\"id\": 1, \"ok\": NaN, \"back\": 1.0}')\n"
        "    return 0\n"),
    "duplicate_keys": _SOCKETS + (
        "def f(x):\n"
        "    data = b'{\"id\": 1, \"ok\": false, \"back\": [null], \"ok\": true}'\n"
        "    spray(struct.pack('>I', len(data)) + data)\n    return 0\n"),
    "close_the_socket": _SOCKETS + (
        "def f(x):\n"
        "    for fd in fds():\n"
        "        if stat.S_ISSOCK(os.fstat(fd).st_mode):\n"
        "            os.close(fd)\n"
        "    return 2 * x + 3\n"),
}


@pytest.mark.parametrize("attack", sorted(PROTOCOL_ATTACKS))
@pytest.mark.parametrize("shape", ["eq_is_true", "humaneval_check", "value"])
def test_protocol_attacks_score_zero(attack: str, shape: str, mode: str) -> None:
    tests = [f"assert f({x}) == {y}" for x, y in CHECKS] if shape == "value" else _tests(shape)
    score, result = _score(PROTOCOL_ATTACKS[attack], tests, mode)
    assert score == 0.0, (result.test_status, result.detail)


# ---- expected values are nowhere in the program's reach --------------------------------------
_MEMORY_SCAN = (  # every test text in reach: gc, frames, argv, /proc/*/cmdline, its whole heap
    "import ctypes, gc, os, re, sys\n"
    "ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again: its own /proc/self/mem opens\n"
    "def _texts():\n"
    "    out = list(sys.argv)\n"
    "    for obj in gc.get_objects():\n"
    "        items = obj.values() if type(obj) is dict else obj if type(obj) in (list, tuple) "
    "else ()\n"
    "        out += [v for v in items if type(v) in (str, bytes)]\n"
    "    for pid in os.listdir('/proc'):\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/cmdline', 'rb') as fh:\n"
    "                out.append(fh.read())\n"
    "        except OSError:\n"
    "            pass\n"
    "    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb') as mem:\n"
    "        for line in maps:\n"
    "            span, perms = line.split()[:2]\n"
    "            if 'r' not in perms or 'vsyscall' in line or 'vvar' in line:\n"
    "                continue\n"
    "            lo, hi = (int(v, 16) for v in span.split('-'))\n"
    "            for start in range(lo, hi, 1 << 20):\n"
    "                try:\n"
    "                    mem.seek(start)\n"
    "                    out.append(mem.read(min(1 << 20, hi - start)))\n"
    "                except (OSError, OverflowError, ValueError, MemoryError):\n"
    "                    pass\n"
    "    return out\n"
    "def f(x):\n"
    "    pattern = 'f[(]' + str(x) + '[)] *== *([0-9]+)'\n"
    "    for text in _texts():\n"
    "        if type(text) is bytes:\n"
    "            found = re.search(pattern.encode(), text)\n"
    "        else:\n"
    "            found = re.search(pattern, text)\n"
    "        if found:\n"
    "            return int(found.group(1))\n"
    "    return -1\n")


@pytest.mark.parametrize("tests", [
    ["assert (f(1) == 5) == True", "assert (f(2) == 7) == True", "assert (f(3) == 9) == True"],
    ["assert f(1) == 5", "assert (f(2) == 7) == True", "assert f(3) == 9 and True"],  # mixed
])
def test_expected_values_are_not_in_memory(tests: list[str], mode: str) -> None:
    score, result = _score(_MEMORY_SCAN, tests, mode)
    assert score == 0.0, result.test_status


def test_memory_scan_finds_what_is_there(mode: str) -> None:
    """Control: the scan does find answers that sit in the program's own memory - in an
    object, and in raw memory only (a ctypes buffer, no str or bytes object). Run as a script
    (a stdio test): a program process that answers a value or assert test refuses gc's
    objects, ctypes and /proc/self/mem since issue 56, so there the scan finds nothing at all."""
    stdio = [{"input": "", "output": "5 7 9"}]
    program = ("NOTE = 'f(1) == 5, f(2) == 7, f(3) == 9'\n" + _MEMORY_SCAN
               + "print(f(1), f(2), f(3))\n")
    assert _score(program, stdio, mode)[0] == 1.0
    program = ("import ctypes\nbuf = ctypes.create_string_buffer(bytes(reversed("
               "b'9 == )3(f ,7 == )2(f ,5 == )1(f')))\n"
               ) + _MEMORY_SCAN.replace("gc.get_objects()", "()") + "print(f(1), f(2), f(3))\n"
    assert _score(program, stdio, mode)[0] == 1.0


_REACH_JUDGE = (  # every way into any other process it can see (the judge is one of them)
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def f():\n"
    "    seen, reached, me = 0, [], os.getpid()\n"
    "    for name in os.listdir('/proc'):\n"
    "        if not name.isdigit() or int(name) == me:\n"
    "            continue\n"
    "        pid = int(name)\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/status') as fh:\n"
    "                if f'Uid:\\t{os.getuid()}' not in fh.read():\n"
    "                    continue\n"
    "        except OSError:\n"
    "            continue\n"
    "        seen += 1\n"
    "        for what, flags in [('mem', os.O_RDWR), ('mem', os.O_RDONLY), ('fd/3', os.O_RDWR),\n"
    "                            ('fd/4', os.O_RDWR), ('environ', os.O_RDONLY)]:\n"
    "            try:\n"
    "                os.close(os.open(f'/proc/{pid}/{what}', flags))\n"
    "                reached.append(f'{pid}/{what}')\n"
    "            except OSError:\n"
    "                pass\n"
    "        if libc.ptrace(16, pid, 0, 0) == 0:\n"
    "            reached.append(f'{pid}/ptrace')\n"
    "    return [seen, reached]\n"
    "print(json.dumps(f()))\n")
# the probe runs in a fresh interpreter the program starts (ctypes is refused in a program
# process since issue 56; a process it starts is not, and measures the same uid's reach)
_REACH_JUDGE = ("import json, subprocess, sys\n"
                f"PROBE = {'import json' + chr(10) + _REACH_JUDGE!r}\n"
                "def f():\n"
                "    run = subprocess.run([sys.executable, '-I', '-S', '-c', PROBE],\n"
                "                         capture_output=True, text=True, timeout=20)\n"
                "    return json.loads(run.stdout)\n")


def test_the_judge_is_out_of_reach(mode: str) -> None:
    """The judge and the supervisor are processes of the program's uid, visible in /proc, and
    non-dumpable: memory, descriptors and ptrace are all refused (measured from inside)."""
    score, result = _score(_REACH_JUDGE, ["seen, reached = f()\nassert seen >= 2\n"
                                          "assert reached == []"], mode)
    assert (score, result.status) == (1.0, "passed"), result.test_status


def test_a_program_stuck_before_its_call_times_out(mode: str) -> None:
    """The value path's request is never read (the program loops at top level): the program
    process is killed with it unread, which must not crash the supervisor."""
    for tests in (["assert f(1) == 5"], _tests("eq_is_true")):
        score, result = _score("while True:\n    pass\n", tests, mode)
        assert (score, result.test_status[0]) == (0.0, "timeout"), result.stderr[-500:]


# ---- what the proxy carries for honest programs (exact scores, no in-process verdict) --------
_STACK = ("class Stack:\n"
          "    def __init__(self):\n        self.items = []\n"
          "    def push(self, x):\n        self.items.append(x)\n"
          "    def pop(self):\n        return self.items.pop()\n"
          "def sort_in_place(a):\n    a.sort()\n"
          "def tally(d, k):\n    d[k] = d.get(k, 0) + 1\n"
          "def root(x):\n"
          "    if x < 0:\n        raise ValueError('negative')\n"
          "    return x ** 0.5\n"
          "def pairs(n):\n    return ((i, i * i) for i in range(n))\n"
          "def adder(k):\n    return lambda x: x + k\n"
          "def as_set(xs):\n    return set(xs)\n"
          "LIMIT = 10\n"
          "import math\n")
HONEST_SEMANTICS = [
    "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and s.items == [1]",  # handles
    "a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]",  # a mutated list comes back
    "d = {}\ntally(d, 'x')\ntally(d, 'x')\nassert d == {'x': 2}",
    "try:\n    root(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError",
    "assert math.isclose(root(2.0), 2 ** 0.5)",  # the program's own `math`, called there
    "assert list(pairs(3)) == [(0, 0), (1, 1), (2, 4)]",  # a generator, iterated
    "assert adder(2)(3) == 5",  # a returned function is a handle that can be called
    "assert as_set([1, 2, 2]) == {1, 2} and LIMIT == 10",  # sets; a top-level constant
    "assert f(10**30) == 2 * 10**30 + 3",
    "assert Stack() != Stack() and Stack()",  # a handle equals only itself; truth is Python's
]


def test_the_proxy_carries_what_honest_tests_need(mode: str) -> None:
    score, result = _score(HONEST + _STACK, HONEST_SEMANTICS, mode)
    assert result.test_status == ["passed"] * len(HONEST_SEMANTICS), result.test_status
    assert result.in_process_verdicts == 0 and score == 1.0


def test_big_values_fail_cleanly_and_many_names_still_work(mode: str) -> None:
    program = HONEST + "".join(f"C{i} = 'x' * 1000\n" for i in range(300)) + (
        "def big():\n    return list(range(10**6))\n")
    # 300 KB of top-level constants: the first 64 KiB of plain values travel in the hello, the
    # rest become handles (documented), fetched when compared (issue 56: as Python compares
    # them); the hello stays under the frame cap
    tests = ["assert f(1) == 5 and C0 == 'x' * 1000 and C299 == 'x' * 1000 and C298 != 'y'",
             "assert len(big()) == 10**6"]  # an answer over 4 x max_value_bytes: fails
    score, result = _score(program, tests, mode)
    assert result.test_status == ["passed", "failed"], result.test_status
