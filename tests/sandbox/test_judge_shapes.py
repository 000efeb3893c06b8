"""Judge holes of issue 32: each class has a wrong program that plain Python scores 0 (it must
score 0 here), and the honest shapes the issue lists must score what plain Python gives them.
Both sandbox modes (the `mode` fixture of test_adversarial_programs)."""

from __future__ import annotations

import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed, split_tests
from tests.sandbox.test_adversarial_programs import mode

__all__ = ["mode"]

LIMITS = SandboxLimits(timeout_s=3.0)


def _score(program: str, tests: str | list, mode: str) -> tuple[float, object]:
    return code_reward_detailed(program, tests, 3.0, partial=True, mode=mode, limits=LIMITS)


# ---- 1. statements after the last top-level assert run --------------------------------------
def test_statements_after_the_last_assert_run(mode: str) -> None:
    wrong = "def f(x):\n    return 3\n"
    tests = ("assert f(1) == 3\n"
             "for x in [2, 3]:\n    assert f(x) == 2 * x + 1\n"
             "def check(g):\n    assert g(4) == 9\n"
             "check(f)\n"
             "if __name__ == '__main__':\n    assert f(5) == 11\n")
    score, result = _score(wrong, tests, mode)
    assert score < 1.0 and result.test_status[-1] == "failed", result.test_status
    honest = "def f(x):\n    return 2 * x + 1\n"
    assert _score(honest, tests, mode)[0] == 1.0
    # a stack popped by two asserts: the second sees the first pop, as in plain Python
    stack = ("class Stack:\n    def __init__(self):\n        self.items = [1, 2]\n"
             "    def pop(self):\n        return self.items.pop()\n")
    assert _score(stack, "s = Stack()\nassert s.pop() == 2\nassert s.pop() == 1\n",
                  mode)[0] == 1.0


def test_a_test_string_is_split_into_prefixes() -> None:
    tests = "x = 1\nassert x == 1\nx = 2\nassert x == 2\nprint(x)\n"
    assert split_tests(tests) == ["x = 1\nassert x == 1", tests]


# ---- 2, 8. every program name is the program's: nothing it binds runs in the judge ----------
_REDEFINE = "globals().__setitem__('f', lambda x: 5)"  # would make the test's f(1) == 5 true
_LIAR = "class L:\n    def __eq__(self, other):\n        return True\n"
_FORGE = ("import sys\nmain = sys.modules['__main__']\nreal = main.describe_names\n"
          "def forged(namespace, handles):\n    names = real(namespace, handles)\n"
          "    names['decode'] = {how!r}\n    return names\n"
          "main.describe_names = forged\n")
ALIASES = {
    "exec_alias": ("decode = exec\n", "decode(encode(1))\nassert f(1) == 5"),
    "eval_alias": ("from builtins import eval as decode\n",
                   "decode(encode(1))\nassert f(1) == 5"),
    "forged_builtin": (_FORGE.format(how=["a", "builtins", "eval"]),
                       "decode(encode(1))\nassert f(1) == 5"),
    "forged_chain": (_FORGE.format(how=["a", "dataclasses", "inspect.builtins.eval"]),
                     "decode(encode(1))\nassert f(1) == 5"),
    "range_alias": (_LIAR + "Rect = range\n", "assert g(Rect(3)) == 3"),
    "type_alias": (_LIAR + "make = type\n", "assert g(make(1)) == 1"),
}
_COMMON = (f"def encode(x):\n    return {_REDEFINE!r}\n"
           "def f(x):\n    return 0\ndef g(x):\n    return L()\n")


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_program_names_run_in_the_program(name: str, mode: str) -> None:
    program, test = ALIASES[name]
    score, result = _score(program + _COMMON, [test], mode)
    assert score == 0.0 and result.in_process_verdicts == 0, result.test_status


# ---- 3. the judge never runs code made from the program's output ----------------------------
_PAYLOAD = ("import os\nd = b'{\"verdict\":\"passed\",\"top\":true}'\n"
            "for i in range(3, 64):\n    try:\n"
            "        os.write(i, len(d).to_bytes(4, 'big') + d)\n"
            "    except OSError:\n        pass\nos._exit(0)\n")


@pytest.mark.parametrize("test", [
    "assert eval(f(1)) == 5",
    "exec(f(1))\nassert False",
    "import pickle\nassert pickle.loads(bytes.fromhex(f(2))) == 5",
    "import builtins\nassert builtins.eval(f(1)) == 5",
])
def test_program_output_is_never_run_in_the_judge(test: str, mode: str) -> None:
    # the string writes a pass on every descriptor and leaves, if it runs in the judge
    program = (f"import pickle\nPAYLOAD = {_PAYLOAD!r}\n"
               "class P:\n    def __reduce__(self):\n        return (exec, (PAYLOAD,))\n"
               "def f(x):\n"
               "    return pickle.dumps(P()).hex() if x == 2 else 'exec(%r)' % PAYLOAD\n")
    score, result = _score(program, [test], mode)
    assert score == 0.0 and result.test_status == ["failed"], result.test_status


def test_the_standard_library_still_makes_code_in_the_judge(mode: str) -> None:
    test = ("from collections import namedtuple\nfrom dataclasses import dataclass\n"
            "P = namedtuple('P', 'x y')\n@dataclass\nclass Q:\n    x: int\n"
            "assert P(f(1), 2).x == 5 and Q(f(1)).x == 5")
    assert _score("def f(x):\n    return 2 * x + 3\n", [test], mode)[0] == 1.0


# ---- 4. exactly one verdict frame from a judge that exits cleanly ---------------------------
def test_a_killed_judge_is_never_a_pass(mode: str) -> None:
    program = ("import os, signal\n"
               "def f(x):\n"
               "    for pid in range(2, 4096):\n"
               "        if pid != os.getpid():\n"
               "            try:\n                os.kill(pid, signal.SIGKILL)\n"
               "            except OSError:\n                pass\n"
               "    return 5\n")
    score, result = _score(program, ["assert (f(1) == 6) == True"], mode)
    assert score == 0.0, result.test_status


def test_the_supervisor_takes_one_frame_from_a_clean_exit() -> None:
    import os

    from posttrain.sandbox.harness import _judge_report
    from posttrain.sandbox.wire import dumps_frame

    passed, failed = dumps_frame({"verdict": "passed", "top": True}), \
        dumps_frame({"verdict": "failed", "top": True})
    top = dumps_frame({"top": True})
    clean, killed = 0, 9  # wait statuses: exit 0, killed by SIGKILL
    assert _judge_report(top + passed, clean) == {"verdict": "passed", "top": True}
    assert _judge_report(top + failed + passed, clean) is None  # two verdicts
    assert _judge_report(top + passed, killed) is None
    assert _judge_report(top + passed, 1 << 8) is None  # exit status 1
    assert os.WIFSIGNALED(killed)


# ---- 5. an in-process fallback's source never reaches the supervisor ------------------------
SCAN = ("import ctypes, sys\n"
        "def found():\n"
        "    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable: /proc/self/mem opens\n"
        "    head, tail = b'expected_', str(7390 + 1).encode()\n"
        "    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb') as mem:\n"
        "        for line in maps:\n"
        "            span, perms = line.split()[:2]\n"
        "            if 'r' not in perms or 'vsyscall' in line or 'vvar' in line:\n"
        "                continue\n"
        "            lo, hi = (int(v, 16) for v in span.split('-'))\n"
        "            for start in range(lo, hi, 1 << 20):\n"
        "                try:\n"
        "                    mem.seek(start)\n"
        "                    chunk = mem.read(min(1 << 20, hi - start))\n"
        "                except (OSError, OverflowError, ValueError, MemoryError):\n"
        "                    continue\n"
        "                at = chunk.find(head)\n"
        "                while at >= 0:\n"
        "                    if chunk[at + 9:at + 13] == tail:\n"
        "                        return True\n"
        "                    at = chunk.find(head, at + 1)\n"
        "    return False\n"
        "def apply(g, x):\n    return g(x)\n"
        # a script (stdio test) scans: a program process answering a value or assert test
        # refuses ctypes and /proc/self/mem since issue 56; a script is forked alike
        "if sys.stdin.read() == 'scan':\n    print(found())\n")


def test_a_fallback_source_is_not_in_later_program_processes(mode: str) -> None:
    secret = "expected_7391 = {'k': 424242}"
    # test 0 falls back (a lambda); test 1's program process scans its own memory for it
    scan = SCAN
    tests = [f"{secret}\nassert apply(lambda x: x, 1) == 1",
             {"input": "scan", "output": "False"}]
    score, result = _score(scan, tests, mode)
    assert result.test_status == ["passed", "passed"], result.test_status
    assert result.in_process_verdicts == 1


# ---- 6. host-wide memory counters are not visible to concurrent runs (bwrap) ----------------
def test_host_memory_counters_are_empty_under_bwrap(mode: str) -> None:
    if mode != "bwrap":
        pytest.skip("limits mode has no mount namespace: documented as not contained")
    program = ("def f():\n    return [open('/proc/' + n).read() for n in "
               "('meminfo', 'vmstat', 'zoneinfo', 'loadavg')]\n")
    score, result = code_reward_detailed(program, ["assert f() == ['', '', '', '']"], 3.0,
                                         mode="bwrap")
    assert score == 1.0, result.test_status


def test_sysinfo_is_refused(mode: str) -> None:
    # the system call behind free/shared memory figures: host-wide, so refused (ENOSYS)
    program = ("import ctypes\nbuf = ctypes.create_string_buffer(256)\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               "def f():\n    return libc.sysinfo(buf), ctypes.get_errno()\n"
               "print(f())\n")  # a script: ctypes is refused in value / assert program processes
    score, result = _score(program, [{"input": "", "output": "(-1, 38)"}], mode)
    assert score == 1.0, result.test_status


# ---- 7. truthiness of a program object is Python's ------------------------------------------
def test_truth_of_a_program_object_is_pythons(mode: str) -> None:
    wrong = "def f(x):\n    return object()\n"
    assert _score(wrong, ["assert not f(1)"], mode)[0] == 0.0
    honest = ("class Empty:\n    def __len__(self):\n        return 0\n"
              "def f(x):\n    return Empty()\n")
    assert _score(honest, ["assert not f(1)"], mode)[0] == 1.0


# ---- honest shapes: what plain Python gives them ---------------------------------------------
_HONEST = ("def fill(a, n=1):\n    a.append(n)\n"
           "def inner(a):\n    a[0].append(9)\n"
           "class Keeper:\n    def __init__(self, a):\n        self.a = a\n"
           "    def add(self, x):\n        self.a.append(x)\n"
           "def gen():\n    yield 1\n    yield 2\n"
           "def naturals():\n    n = 0\n    while True:\n        yield n\n        n += 1\n"
           "def same(a):\n    return a\n"
           "def documented():\n    'Adds things.'\n"
           "def missing(d):\n    return d['x']\n"
           "def stops(x):\n    raise StopIteration\n")
HONEST_SHAPES = [
    "a = []\nfill(a=a, n=3)\nassert a == [3]",  # copied back by keyword
    "b = [1]\na = [b]\ninner(a)\nassert b == [1, 9] and a[0] is b",  # nested, in place
    "a = []\nk = Keeper(a)\nk.add(4)\nassert a == [4]",  # kept by one call, changed by a later
    "a = [1]\nk = Keeper(a)\na.append(2)\nk.add(3)\nassert a == [1, 2, 3]",
    "g = gen()\nassert next(g) == 1 and next(g) == 2",  # next() on a returned generator
    "import itertools\nassert list(itertools.islice(naturals(), 4)) == [0, 1, 2, 3]",
    "a = [1]\nassert same(a) is a",
    "assert documented.__doc__ == 'Adds things.' and documented.__name__ == 'documented'",
    "try:\n    missing({})\nexcept KeyError as e:\n    assert e.args == ('x',)\n"
    "else:\n    raise AssertionError",
    "try:\n    list(map(stops, [1, 2]))\nexcept RuntimeError:\n    pass\n"
    "else:\n    raise AssertionError",  # PEP 479: never ends a loop of the test early
]


@pytest.mark.parametrize("shape", range(len(HONEST_SHAPES)))
def test_honest_shapes_score_what_python_gives(shape: int, mode: str) -> None:
    score, result = _score(_HONEST, [HONEST_SHAPES[shape]], mode)
    assert result.test_status == ["passed"], (HONEST_SHAPES[shape], result.test_status)
    assert result.in_process_verdicts == 0 and score == 1.0


STDIO_PROGRAMS = {
    "fastio": ("import os, sys\nfrom io import BytesIO, IOBase\n"
               "class Out(IOBase):\n    def __init__(self):\n        self.buf = BytesIO()\n"
               "    def write(self, s):\n        self.buf.write(s.encode())\n"
               "    def flush(self):\n        os.write(1, self.buf.getvalue())\n"
               "        self.buf = BytesIO()\n"
               "sys.stdout = Out()\nprint(sum(map(int, input().split())))\n"),
    "thread": ("import sys, threading, time\nsys.setrecursionlimit(10000)\n"
               "threading.stack_size(1 << 26)\n"
               "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
               "def main():\n    time.sleep(0.2)\n"
               "    print(sum(map(int, input().split())) + depth(5000) - 5000)\n"
               "threading.Thread(target=main).start()\n"),
    "unclosed_writer": ("out = open(1, 'w', closefd=False)\n"
                        "out.write(str(sum(map(int, input().split()))) + '\\n')\n"),
    "atexit": ("import atexit\nx = sum(map(int, input().split()))\n"
               "atexit.register(lambda: print(x))\n"),
    "flush_then_os_exit": ("import os, sys\nprint(sum(map(int, input().split())))\n"
                           "sys.stdout.flush()\nos._exit(0)\n"),
}


@pytest.mark.parametrize("name", sorted(STDIO_PROGRAMS))
def test_stdio_programs_exit_like_python(name: str, mode: str) -> None:
    tests = [{"input": "1 2\n", "output": "3\n"}]
    score, result = _score(STDIO_PROGRAMS[name], tests, mode)
    assert score == 1.0, result.test_status


# ---- data: MBPP's test_imports go before every assert test ----------------------------------
def test_test_imports_make_the_test_use_its_own_module(mode: str) -> None:
    # the program's `math` lies; with the row's test_imports the test uses its own
    program = ("import math\nmath.isclose = lambda a, b: True\n"
               "def f(x):\n    return 0.0\n")
    tests = ["assert math.isclose(f(1), 5.0)"]
    score = code_reward_detailed(program, tests, 3.0, mode=mode, limits=LIMITS,
                                 test_imports=["import math"])[0]
    assert score == 0.0
    assert code_reward_detailed("def f(x):\n    return 5.0\n", tests, 3.0, mode=mode,
                                limits=LIMITS, test_imports=["import math"])[0] == 1.0
