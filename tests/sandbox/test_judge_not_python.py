"""Judge holes of issue 56: where the judge does not reproduce plain Python, the test fails,
never passes. One test per class (the held-out programs are not given: each test is a class's
shape), in both sandbox modes (the `mode` fixture of test_adversarial_programs)."""

from __future__ import annotations

import random

import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from tests.sandbox.test_adversarial_programs import mode

__all__ = ["mode"]

LIMITS = SandboxLimits(timeout_s=3.0)


def _score(program: str, tests: str | list, mode: str) -> tuple[float, object]:
    return code_reward_detailed(program, tests, 3.0, partial=True, mode=mode, limits=LIMITS)


# ---- 4. the import guard resolves the file it loads; a code object's file name is data -----
# A module the program wrote that rewrites the test's `f` (a wrong f(1) == 0 then passes).
_PATCH = ("import sys\nfr = sys._getframe()\n"
          "while fr is not None and fr.f_code.co_filename != '<test>':\n    fr = fr.f_back\n"
          "fr.f_globals['f'] = lambda x: 5\n")


@pytest.fixture
def where() -> str:
    return f"/tmp/judge56_{random.randrange(10**9)}"


def test_a_module_reached_through_dotdot_from_the_stdlib_never_runs(mode: str, where: str
                                                                    ) -> None:
    program = (f"import os\nos.makedirs({where!r})\n"
               f"open({where!r} + '/evil.py', 'w').write({_PATCH!r})\n"
               "def f(x):\n    return 0\n")
    test = ("import os, sys\nstdlib = os.path.dirname(os.__file__)\n"  # <stdlib>/../../../tmp/..
            f"sys.path.insert(0, stdlib + '/..' * stdlib.count('/') + {where!r})\n"
            "import evil\nassert f(1) == 5\n")
    score, result = _score(program, [test], mode)
    assert score == 0.0 and result.test_status == ["failed"], result.test_status


def test_a_pyc_claiming_a_stdlib_file_name_never_runs(mode: str, where: str) -> None:
    program = ("import os, marshal, importlib.util\n"
               f"os.makedirs({where!r})\n"
               f"code = compile({_PATCH!r}, os.path.dirname(os.__file__) + '/fractions.py', "
               "'exec')\n"
               f"open({where!r} + '/evil.pyc', 'wb').write(importlib.util.MAGIC_NUMBER + "
               "b'\\0' * 12 + marshal.dumps(code))\n"
               "def f(x):\n    return 0\n")
    test = f"import sys\nsys.path.insert(0, {where!r})\nimport evil\nassert f(1) == 5\n"
    score, result = _score(program, [test], mode)
    assert score == 0.0 and result.test_status == ["failed"], result.test_status


def test_the_standard_library_still_imports_during_a_test(mode: str) -> None:
    test = ("from fractions import Fraction\nimport statistics, decimal, heapq, string\n"
            "from collections import namedtuple\nfrom dataclasses import dataclass\n"
            "P = namedtuple('P', 'x y')\n"
            "@dataclass\nclass Q:\n    a: int\n"
            "assert f(1) == 5 and Fraction(1, 2) == 0.5 and statistics.mean([1, 3]) == 2\n"
            "assert P(1, 2).x == 1 and Q(3).a == 3\n")
    assert _score("def f(x):\n    return 5\n", [test], mode)[0] == 1.0


def _statuses(program: str, tests: list[str], mode: str) -> list[str]:
    return _score(program, tests, mode)[1].test_status


# ---- 1. copies where Python shares: the program's lists, dicts and sets are shared ----------
_SHARING = ("class S:\n    def __init__(self):\n        self._i = [1]\n"
            "    def items(self):\n        return self._i\n"
            "    def add(self, x):\n        self._i.append(x)\n"
            "TABLE = [1, 2]\n"
            "def grow(x):\n    TABLE.append(x)\n"
            "CACHE = {1: 5}\n"
            "def f(x):\n    return CACHE.get(x, 0)\n"
            "X = [1]\n"
            "def rebind():\n    global X\n    X = [2]\n"
            "def fresh():\n    return [3, 1, 2]\n")
# each passes where a copy stood in for the program's object, and fails in plain Python
SHARED_WRONG = [
    "s = S()\nv = s.items()\nv.append(99)\nassert s.items() == [1]",  # a leaky accessor
    "s = S()\nv = s.items()\ns.add(2)\nassert v == [1]",  # the program changes it later
    "t = TABLE\ngrow(3)\nassert t == [1, 2]",  # a table the test holds
    "CACHE.clear()\nassert f(1) == 5",  # a poisoned cache the test clears
    "v = [fresh()]\nv[0].append(4)\nassert len(fresh()) == 3 and v[0] == [3, 1, 2]",
]
SHARED_HONEST = [
    "s = S()\nv = s.items()\nv.append(99)\nassert s.items() == [1, 99] and s.items() is v",
    "t = TABLE\ngrow(3)\nassert t == [1, 2, 3] and t is TABLE",
    "a = X\nrebind()\nassert X == [2] and a == [1]",
    "r = fresh()\nr.sort()\nassert r == [1, 2, 3] and sorted(fresh()) == r",
    "CACHE[2] = 7\nassert f(2) == 7",
]


def test_the_programs_lists_dicts_and_sets_are_shared(mode: str) -> None:
    assert _statuses(_SHARING, SHARED_WRONG, mode) == ["failed"] * len(SHARED_WRONG)
    assert _statuses(_SHARING, SHARED_HONEST, mode) == ["passed"] * len(SHARED_HONEST)


# ---- 2. a subclass of a plain type: its base value by the base type's methods; overrides ----
_SUBCLASSES = (
    "from collections import Counter, OrderedDict, defaultdict, namedtuple\n"
    "class D(dict):\n"  # storage {'b': 2}; every override shows {'a': 1}
    "    def items(self):\n        return [('a', 1)]\n"
    "    def keys(self):\n        return ['a']\n"
    "    def __iter__(self):\n        return iter(['a'])\n"
    "    def __getitem__(self, k):\n        return 1\n"
    "    def __len__(self):\n        return 1\n"
    "    def __repr__(self):\n        return \"{'a': 1}\"\n"
    "    def __reduce__(self):\n        return (dict, ({'a': 1},))\n"
    "class L(list):\n"  # storage [9]; the overrides show [1]
    "    def __iter__(self):\n        return iter([1])\n"
    "    def __getitem__(self, i):\n        return 1\n"
    "    def __len__(self):\n        return 1\n"
    "class Twice(list):\n"
    "    def append(self, x):\n        list.append(self, x)\n        list.append(self, x)\n"
    "class Always(set):\n    def __contains__(self, x):\n        return True\n"
    "class Ne(tuple):\n    def __eq__(self, other):\n        return False\n"
    "    __hash__ = tuple.__hash__\n"
    "class Falsy(int):\n    def __bool__(self):\n        return False\n"
    "class Short(str):\n    def __len__(self):\n        return 3\n"
    "class Stack(list):\n    def push(self, x):\n        self.append(x)\n"
    "    def peek(self):\n        return self[-1]\n"
    "class Shout(str):\n    def upper(self):\n        return 'LOUD'\n"
    "P = namedtuple('P', 'x y')\n"
    "def make(kind, *args, **kwargs):\n    return kind(*args, **kwargs)\n"
    "def bad():\n    return D(b=2)\n"
    "def ne():\n    return Ne((1, 2))\n"
    "def counts(s):\n    return Counter(s)\n")
SUBCLASS_WRONG = [
    "assert (make(D, b=2) == {'a': 1}) == True",
    "assert make(D, b=2) == {'a': 1}",  # the value path: compared outside, by its storage
    "assert (make(L, [9]) == [1]) == True",
    "assert make(L, [9]) == [1]",
    "t = make(Twice)\nt.append(1)\nassert t == [1]",  # a redefined method with a bug
    "assert 5 not in make(Always, [1])",
    "assert (make(Ne, (1, 2)) == (1, 2)) == True",
    "assert make(Ne, (1, 2)) == (1, 2)",
    "assert bad() == {'a': 1}",  # the value path (compared outside): by its storage
    "assert ne() == (1, 2)",  # the value path: its own == would run in Python
    "assert make(Falsy, 5)",
    "assert len(make(Short, 'abcde')) == 5",
]
SUBCLASS_HONEST = [
    "c = make(Counter, 'aab')\nassert c == {'a': 2, 'b': 1} and c['z'] == 0",
    "c = make(Counter, 'ab')\nc.update('a')\nassert c.most_common(1) == [('a', 2)]",
    "assert counts('ab') == {'a': 1, 'b': 1}",  # value path: Counter's == is dict's
    "p = make(P, 1, 2)\nassert p == (1, 2) and p.x == 1 and str(p) == 'P(x=1, y=2)'",
    "s = make(Stack)\ns.push(1)\ns.push(2)\nassert s.peek() == 2 and s == [1, 2] and len(s) == 2",
    "d = make(defaultdict, int)\nd['a'] += 1\nassert d == {'a': 1}",
    "assert make(Shout, 'hi').upper() == 'LOUD' and make(Shout, 'hi') == 'hi'",
    "o = make(OrderedDict, a=1, b=2)\no.move_to_end('a')\nassert list(o) == ['b', 'a']",
    "t = make(Twice)\nt.append(1)\nassert t == [1, 1]",
]


def test_a_subclass_is_read_by_its_base_type_and_its_overrides_are_the_programs(mode: str
                                                                               ) -> None:
    assert _statuses(_SUBCLASSES, SUBCLASS_WRONG, mode) == ["failed"] * len(SUBCLASS_WRONG)
    assert _statuses(_SUBCLASSES, SUBCLASS_HONEST, mode) == ["passed"] * len(SUBCLASS_HONEST)


# ---- 3. equality and `in` of a program object: asked, typed, or the test fails --------------
_OBJECTS = ("class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
            "class Hashed(AlwaysEqual):\n    __hash__ = object.__hash__\n"
            "class Bag:\n    def __init__(self, xs):\n        self.xs = xs\n"
            "    def __iter__(self):\n        return iter(self.xs)\n"
            "    def __contains__(self, x):\n        return False\n"
            "class Yes:\n    def __contains__(self, x):\n        return True\n"
            "class Plain:\n    pass\n"
            "def make(kind, *args):\n    return kind(*args)\n")
OBJECT_WRONG = [
    "assert make(AlwaysEqual) != 5",
    "assert not (make(AlwaysEqual) == 5)",
    "assert len({make(AlwaysEqual), make(AlwaysEqual)}) == 2",  # unhashable in Python
    "assert len({make(Hashed): 1, 5: 2}) == 2 and make(Hashed) != 5",
    "assert 5 not in make(Yes)",
    "assert 1 in make(Bag, [1, 2])",  # its own __contains__, not its iteration
    "try:\n    assert make(AlwaysEqual) != 5\nexcept BaseException:\n    pass\n",  # caught
]
OBJECT_HONEST = [
    "a = make(Plain)\nassert a == a and a != make(Plain) and a is not None",
    "assert make(Plain) not in [make(Plain)] and len({make(Plain), make(Plain)}) == 2",
    "assert 7 in make(Yes) and 3 not in make(Bag, [3])",
    "b = make(Bag, [1])\nassert [x for x in b] == [1]",
]


def test_equality_and_in_of_a_program_object_are_pythons_or_fail(mode: str) -> None:
    assert _statuses(_OBJECTS, OBJECT_WRONG, mode) == ["failed"] * len(OBJECT_WRONG)
    assert _statuses(_OBJECTS, OBJECT_HONEST, mode) == ["passed"] * len(OBJECT_HONEST)


def test_main_is_the_programs_own_module(mode: str) -> None:
    """`sys.modules['__main__']` in a program process is the program's module (plain Python's),
    never the supervisor's: its encoder cannot be replaced that way (a frame's globals still
    can: documented as not closed)."""
    forge = ("import sys\nm = sys.modules['__main__']\nreal = m.wire_encode\n"
             "m.wire_encode = lambda v, *a, **k: real(5 if v == 0 else v, *a, **k)\n"
             "def f(x):\n    return 0\n")
    for test in ("assert f(1) == 5", "assert (f(1) == 5) == True"):  # fails at its top level
        assert _statuses(forge, [test], mode) == ["failed"]
    honest = "import __main__\nX = 3\ndef f():\n    return __main__.X\n"
    assert _statuses(honest, ["assert f() == 3", "assert (f() == 3) == True"], mode) == \
        ["passed", "passed"]


# ---- limits mode: no network; a stopped supervisor holds its slot for one answer's time -----
def test_no_network_in_either_mode(mode: str) -> None:
    """A server on the host's localhost (a local vLLM server's stand-in) is out of reach: in
    limits mode as root the run has a network namespace of its own (as a non-root user limits
    mode has the host's network: documented)."""
    import os
    import socket

    if mode == "limits" and os.geteuid() != 0:
        pytest.skip("limits mode as a non-root user keeps the host's network (documented)")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        program = ("import socket\ndef reach():\n    try:\n"
                   f"        socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
                   "        return True\n    except OSError:\n        return False\n")
        assert _statuses(program, ["assert reach() == False"], mode) == ["passed"]
    finally:
        server.close()


def test_a_stopped_supervisor_holds_its_slot_for_one_answers_time(mode: str) -> None:
    import time

    program = "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\ndef f():\n    return 1\n"
    limits = SandboxLimits(timeout_s=1.0)
    t0 = time.monotonic()
    result = code_reward_detailed(program, ["assert f() == 1"] * 6, 1.0, partial=True,
                                  mode=mode, limits=limits)[1]
    assert time.monotonic() - t0 < 12.0  # the run's deadline would be 10 + 6 x 2 = 22 s
    # limits: the supervisor stops (every test times out); bwrap: it is its PID namespace's
    # init there, which a signal from inside does not stop (every test passes)
    assert result.test_status in (["timeout"] * 6, ["passed"] * 6), result.test_status


# ---- 5. stale after the last answer: a live thread of the program fails the test -----------
def test_a_live_program_thread_fails_the_test(mode: str) -> None:
    late = ("import threading, time\nX = 1\n"
            "def later():\n    time.sleep(0.2)\n    global X\n    X = 2\n"
            "threading.Thread(target=later).start()\n")
    # plain Python: X is 2 after the wait (the first fails); the judge cannot follow: both fail
    assert _statuses(late, ["import time\ntime.sleep(0.5)\nassert X == 1",
                            "import time\ntime.sleep(0.5)\nassert X == 2"], mode) == \
        ["failed", "failed"]
    joined = ("import threading\nX = []\nt = threading.Thread(target=lambda: X.append(1))\n"
              "t.start()\nt.join()\n")
    assert _statuses(joined, ["assert X == [1]"], mode) == ["passed"]


_AS_NOBODY = """
import json, sys
import posttrain.sandbox.jail as jail
if sys.argv[2] == "host":
    jail._NAMESPACES[:] = [[]]  # the control: the host's network, as before issue 56
program = ("import socket\\ndef reach():\\n    try:\\n        socket.create_connection(("
           "'127.0.0.1', %s), timeout=1).close()\\n        return True\\n"
           "    except OSError:\\n        return False\\nprint(reach())\\n" % sys.argv[1])
tool = jail.run_sandboxed(program, mode="limits")  # how the python tool runs model code
judged = jail.run_sandboxed(program, ["assert reach() == False"], mode="limits")
print(json.dumps([tool.stdout.strip(), judged.test_status]))
"""


def test_limits_mode_as_a_non_root_user_has_no_network() -> None:
    """Limits mode as a non-root user (run here as `nobody` through setpriv): a user namespace
    of its own with a network namespace, so a local server (a vLLM server's stand-in) is out
    of reach of the python tool and of a program under test; the control run without it
    reaches the server, so the check can fail."""
    import json
    import os
    import shutil
    import socket
    import subprocess
    from pathlib import Path

    python, setpriv = "/usr/bin/python3", shutil.which("setpriv")
    if os.geteuid() != 0 or not setpriv or not os.access(python, os.X_OK):
        pytest.skip("needs root (to become nobody), setpriv and /usr/bin/python3")
    server = socket.create_server(("127.0.0.1", 0))
    port, repo = server.getsockname()[1], str(Path(__file__).resolve().parents[2])
    try:
        out = {}
        for network in ("own", "host"):
            run = subprocess.run(
                [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c",
                 _AS_NOBODY, str(port), network], capture_output=True, text=True, timeout=120,
                env={"PYTHONPATH": repo, "PATH": "/usr/bin:/bin", "HOME": "/tmp"}, cwd="/tmp")
            assert run.returncode == 0, run.stderr[-2000:]
            out[network] = json.loads(run.stdout.splitlines()[-1])
    finally:
        server.close()
    assert out["own"] == ["False", ["passed"]], out
    assert out["host"] == ["True", ["failed"]], out
