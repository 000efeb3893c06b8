"""Adversarial programs (issue 4): each must score 0 (or its honest score) within its time limit,
leave no process or file behind and not harm this process - in bwrap mode and in limits-only
mode. A case that limits-only mode does not claim (docs/sandbox.md) is skipped there, with the
reason; `AS_ROOT` marks the claims that rest on dropping root to a sandbox uid."""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from posttrain.sandbox.jail import _bwrap_problem

AS_ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(timeout_s=1.0)
ALL_FAILURES = {"failed", "timeout", "memory", "crashed"}


def _modes() -> list:
    uid = LIMITS.uid_base + 63 if AS_ROOT else None
    bwrap_missing = _bwrap_problem(AS_ROOT, uid)
    return [pytest.param("bwrap", marks=pytest.mark.skipif(bool(bwrap_missing),
                                                           reason=str(bwrap_missing))),
            "limits"]


@pytest.fixture(params=_modes())
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def marker() -> str:
    """A unique string to find this test's processes/files afterwards (also a sleep length)."""
    return f"987.{random.randrange(10**8, 10**9)}"


SESSION_HELPERS = ("math_verify", "multiprocessing.resource_tracker")
"""Children that live for the whole test session: the math-verify workers, and the tracker
Python's multiprocessing starts at its first semaphore (async GRPO's sampler queues)."""


_EARLIER: set[tuple[int, float]] = set()
"""(pid, start time) of our descendants alive when the test started (`tests/sandbox/conftest.py`):
a session helper, or a pool an earlier test left to the session in this process (a pytest-xdist
worker runs many files)."""


def _own_children() -> list[psutil.Process]:
    """Our descendants started during this test, except the session helpers (`SESSION_HELPERS`)."""
    kids = []
    for child in psutil.Process().children(recursive=True):
        try:
            earlier = (child.pid, child.create_time()) in _EARLIER
            if earlier or child.status() == psutil.STATUS_ZOMBIE:
                continue
            if not any(h in " ".join(child.cmdline()) for h in SESSION_HELPERS):
                kids.append(child)
        except psutil.NoSuchProcess:
            continue
    return kids


def _processes_with(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []) and \
                    proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def run_case(program: str, tests: list[str], mode: str, partial: bool = False
             ) -> tuple[float, str]:
    """Score the program; check the deadline and that nothing of the run survived it."""
    score, result = code_reward_detailed(program, tests, LIMITS.timeout_s, partial, mode=mode,
                                         limits=LIMITS)
    assert result.mode == mode
    # liveness guard (not a speed check): every test is bounded by its own deadline
    assert result.duration_s < LIMITS.timeout_s * len(tests) + 10.0
    assert _own_children() == []
    return score, result.status


SCORE_ZERO_CASES = {
    "infinite_loop_top_level": ("while True:\n    pass\n", ["assert True"]),
    "infinite_loop_in_function": ("def f():\n    while True:\n        pass\n", ["f()"]),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass\n", ["assert True"]),
    "fork_bomb_in_function": ("import os\ndef f():\n    while True:\n        try:\n"
                              "            os.fork()\n        except OSError:\n"
                              "            pass\n", ["f()"]),
    "memory_bomb": ("x = bytearray(10**11)\n", ["assert True"]),
    "memory_bomb_loop": ("x = []\nwhile True:\n    x.append(bytearray(10**7))\n",
                         ["assert True"]),
    "output_flood": ("import sys\nwhile True:\n    sys.stdout.write('PASSED ' * 1000)\n",
                     ["assert True"]),
    "sys_exit_before_tests": ("import sys\nsys.exit(0)\ndef f():\n    return 1\n",
                              ["assert f() == 1"]),
    "os_exit_before_tests": ("import os\nos._exit(0)\ndef f():\n    return 1\n",
                             ["assert f() == 1"]),
    "exit_inside_test": ("import os\ndef f():\n    os._exit(0)\n", ["assert f() == 1"]),
    "system_exit_inside_test": ("def f():\n    raise SystemExit(0)\n", ["assert f() == 1"]),
    "fake_pass_markers": (
        "import json, os, sys\n"
        "fake = b'R\\n' + json.dumps({'tests': ['passed'], 'detail': ''}).encode() + b'\\n'\n"
        "print('PASSED\\nall tests passed\\n1.0')\n"
        "sys.stderr.write('OK\\n')\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'U' + bytes(16) + fake)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n", ["assert f(1) == 5"]),
    "tamper_builtins": (
        "import builtins\n"
        "builtins.AssertionError = type('Fake', (Exception,), {})\n"
        "AssertionError = None\n"
        "builtins.exec = lambda *a, **k: None\n"
        "builtins.compile = lambda *a, **k: None\n"
        "builtins.BaseException = type('Fake2', (Exception,), {})\n"
        "def f(x):\n    return 0\n", ["assert f(1) == 5"]),
    "monkeypatch_harness": (
        "import os, sys\n"
        "main = sys.modules['__main__']\n"
        "for name in list(vars(main)):\n"
        "    if callable(getattr(main, name)) and not name.startswith('__'):\n"
        "        setattr(main, name, lambda *a, **k: None)\n"
        "os._exit = lambda *a: None\n"
        "os.write = lambda *a: 0\n"
        "sys.settrace = sys.setprofile = lambda *a: None\n"
        "def f(x):\n    return 0\n", ["assert f(1) == 5"]),
    "trace_hook_skips_assert": (
        "import sys\n"
        "def tracer(frame, event, arg):\n"
        "    if frame.f_code.co_filename.startswith('<test'):\n"
        "        raise SystemExit(0)\n"
        "    return tracer\n"
        "sys.settrace(tracer)\n"
        "def f(x):\n    return 0\n", ["assert f(1) == 5"]),
    "deep_recursion": ("import sys\nsys.setrecursionlimit(10**6)\n"
                       "def f(n):\n    return f(n + 1)\n", ["assert f(0) == 1"]),
    "syntax_error": ("def f(:\n    return 1\n", ["assert f() == 1"]),
    "sleeping_test": ("import time\ndef f():\n    time.sleep(60)\n    return 1\n",
                      ["assert f() == 1"]),
}


@pytest.mark.parametrize("case", sorted(SCORE_ZERO_CASES))
def test_scores_zero(case: str, mode: str) -> None:
    program, tests = SCORE_ZERO_CASES[case]
    score, status = run_case(program, tests, mode)
    assert score == 0.0
    # bytes written on the program's own answer channel break the protocol (issue 23)
    assert status in ALL_FAILURES | ({"sandbox_error"} if case == "fake_pass_markers" else set())


def test_statuses_are_specific(mode: str) -> None:
    assert run_case("x = bytearray(10**11)", ["assert True"], mode)[1] == "memory"
    assert run_case("while True:\n    pass", ["assert True"], mode)[1] == "timeout"
    assert run_case("def f(:", ["assert True"], mode)[1] == "failed"


def test_honest_partial_scores(mode: str) -> None:
    program = "import time\ndef f(x):\n    if x == 2:\n        time.sleep(60)\n    return x\n"
    tests = ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3", "assert f(4) == 5"]
    score, status = run_case(program, tests, mode, partial=True)
    assert score == pytest.approx(0.5)  # tests 0 and 2 pass; 1 times out; 3 fails
    assert status == "timeout"
    fork_then_pass = SCORE_ZERO_CASES["fork_bomb_in_function"][0]
    assert run_case(fork_then_pass, ["f()", "assert True"], mode, partial=True)[0] == 0.5


def test_process_limit_holds_even_for_root(mode: str) -> None:
    """RLIMIT_NPROC does not bind root; the run drops to a sandbox uid so it does."""
    program = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n")
    assert run_case(program, [f"assert n < {LIMITS.nproc}"], mode)[0] == 1.0


def test_output_flood_is_capped(mode: str) -> None:
    _, result = code_reward_detailed("print('x' * 10**7)\nwhile True:\n    print('y' * 1000)",
                                     ["assert True"], LIMITS.timeout_s, mode=mode, limits=LIMITS)
    assert result.status == "timeout"
    assert len(result.stdout) <= LIMITS.max_output_bytes


def test_spawned_processes_do_not_outlive_the_run(mode: str, marker: str) -> None:
    program = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "def f():\n    return 1\n")
    score, _ = run_case(program, ["assert f() == 1"], mode)
    assert score == 1.0  # the honest score: the tests pass
    assert _processes_with(marker) == []


@pytest.fixture
def killers_allowed(mode: str) -> Iterator[None]:
    if mode == "limits" and not AS_ROOT:
        pytest.skip("limits mode under the caller's own uid can signal the caller (docs)")
    yield


@pytest.mark.parametrize("program", [
    "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\n",
    "import os\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n",
    "import os\nfor pid in os.listdir('/proc'):\n"
    "    if pid.isdigit() and int(pid) != os.getpid():\n"
    "        try:\n            os.kill(int(pid), 9)\n        except OSError:\n            pass\n",
])
def test_killing_the_parent_only_fails_the_program(program: str, mode: str,
                                                   killers_allowed: None) -> None:
    program += "def f():\n    return 1\n"
    score, status = run_case(program, ["assert f() == 1", "assert f() == 1"], mode,
                             partial=True)
    assert psutil.Process().is_running()  # we are alive to assert it
    if mode == "bwrap":
        # the supervisor is PID 1 of the namespace: its processes cannot signal it, and they
        # see nothing else, so the kills do nothing and the honest score is kept
        assert (score, status) == (1.0, "passed")
    else:
        # the program can kill its supervisor (same sandbox uid), which only fails the program
        assert (score, status) == (0.0, "crashed")
    # an assert test's judge process is not PID 1: a program that kills everything it can
    # see kills it too, which is a loss only (the judge's verdict is the only pass). Whether
    # the judge is already running when the kill comes is a race (under load it sometimes is
    # not, and then it judges the honest f and passes it), so either outcome is allowed
    # there; what must hold is that the kill never turns into anything else
    score, status = run_case(program, ["assert f() > 0"], mode, partial=True)
    assert psutil.Process().is_running()
    spares_the_judge = mode == "bwrap" and "getppid" in program
    if spares_the_judge:
        assert (score, status) == (1.0, "passed")
    else:
        assert (score, status) in ((0.0, "crashed"), (1.0, "passed"))


def test_cannot_write_outside_its_temp_dir(mode: str, tmp_path: Path, marker: str) -> None:
    if mode == "limits" and not AS_ROOT:
        pytest.skip("limits mode under the caller's own uid can write where the caller can")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.chmod(tmp_path, 0o755)  # reachable, not writable, by another uid
    target = outside / "pwned.txt"
    program = (f"P = {str(target)!r}\n"
               "try:\n    with open(P, 'w') as fh:\n        fh.write('x')\n    ok = True\n"
               "except OSError:\n    ok = False\n")
    assert run_case(program, ["assert ok"], mode)[0] == 0.0
    assert not target.exists()


def test_temp_files_do_not_survive(mode: str, marker: str) -> None:
    names = [f"/tmp/posttrain-adv-{marker}", f"/dev/shm/posttrain-adv-{marker}",
             f"posttrain-adv-{marker}"]
    program = (f"for name in {names!r}:\n"
               "    with open(name, 'w') as fh:\n        fh.write('x')\n"
               "import os\nok = all(os.path.exists(n) for n in " + repr(names) + ")\n")
    if mode == "limits" and not AS_ROOT:
        pytest.skip("limits mode under the caller's own uid cannot tell its files from ours")
    score, _ = run_case(program, ["assert ok"], mode)
    assert score == 1.0  # writing its own temp files is allowed ...
    assert not any(os.path.exists(n) for n in names[:2])  # ... but they do not survive


def test_environment_secret_is_invisible(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "limits" and not AS_ROOT:
        pytest.skip("limits mode under the caller's own uid can read /proc/<caller>/environ")
    monkeypatch.setenv("POSTTRAIN_ADV_SECRET", "hunter2")
    program = (
        "import os\n"
        "found = 'POSTTRAIN_ADV_SECRET' in os.environ\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/environ', 'rb') as fh:\n"
        "                found = found or b'hunter2' in fh.read()\n"
        "        except OSError:\n"
        "            pass\n")
    assert run_case(program, ["assert found"], mode)[0] == 0.0


def test_no_network(mode: str) -> None:
    if mode == "limits" and os.geteuid() != 0:  # as root: a network namespace per run
        pytest.skip("limits mode as a non-root user does not isolate the network "
                    "(docs/sandbox.md)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            "try:\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    s.sendall(b'hi')\n"
            "    connected = True\n"
            "except OSError:\n"
            "    connected = False\n")
        assert run_case(program, ["assert connected"], mode)[0] == 0.0
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


# ---- verdict integrity (issue 9): programs that try to score a pass they did not earn --------
# Every program below is run against three `expr == literal` tests (judged outside the sandbox)
# with partial credit on, so a single forged pass would show as a score above 0.
VALUE_TESTS = ["assert f(1) == 5", "assert f(2) == 7", "assert f(3) == 9"]
_TABLE = (  # answers from any test text the program can find (frames, gc, argv, /proc)
    "import ast, gc, os, re, sys\n"
    "def _texts():\n"
    "    out = list(sys.argv)\n"
    "    for obj in gc.get_objects():\n"
    "        items = obj.values() if type(obj) is dict else obj if type(obj) in (list, tuple) "
    "else ()\n"
    "        out += [v for v in items if type(v) in (str, bytes)]\n"
    "    frame = sys._getframe()\n"
    "    while frame is not None:\n"
    "        out += [v for v in frame.f_locals.values() if type(v) in (str, bytes)]\n"
    "        frame = frame.f_back\n"
    "    for pid in os.listdir('/proc'):\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/cmdline', 'rb') as fh:\n"
    "                out.append(fh.read())\n"
    "        except OSError:\n"
    "            pass\n"
    "    return [t.decode(errors='replace') if type(t) is bytes else t for t in out]\n"
    "def f(x):\n"
    "    for text in _texts():\n"
    "        for m in re.finditer(r'f\\(' + str(x) + r'\\)\\s*==\\s*([-\\d.]+)', text):\n"
    "            return ast.literal_eval(m.group(1))\n")
_FORGE_TOKEN = (  # the pass token: 16 bytes in a frame, written once to every small fd
    "import os, sys\n"
    "def f(x):\n"
    "    frame, tokens, fds = sys._getframe(1), [], set()\n"
    "    while frame is not None:\n"
    "        loc = frame.f_locals\n"
    "        tokens += [v for v in loc.values() if type(v) is bytes and len(v) == 16]\n"
    "        fds |= {v for v in loc.values() if type(v) is int and 2 < v < 64}\n"
    "        fds |= {v for d in loc.values() if type(d) is dict for v in d.values()\n"
    "                if type(v) is int and 2 < v < 64}\n"
    "        frame = frame.f_back\n"
    "    for fd in fds:\n"
    "        try:\n"
    "            os.write(fd, tokens[0])\n"
    "        except (OSError, IndexError):\n"
    "            pass\n"
    "    os._exit(0)\n")
_ATTACK_PREFIX = "import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
VERDICT_ATTACKS = {
    # 1. objects that lie about equality
    "eq_always_true": "class A:\n    def __eq__(self, o):\n        return True\n"
                      "    def __ne__(self, o):\n        return False\n"
                      "def f(x):\n    return A()\n",
    "int_subclass_eq": "class I(int):\n    __hash__ = int.__hash__\n"
                       "    def __eq__(self, o):\n        return True\n"
                       "def f(x):\n    return I(0)\n",
    "float_subclass_eq": "class F(float):\n    __hash__ = float.__hash__\n"
                         "    def __eq__(self, o):\n        return True\n"
                         "def f(x):\n    return F(0.0)\n",
    "str_subclass_repr": "class S(str):\n    def __eq__(self, o):\n        return True\n"
                         "    def __repr__(self):\n        return '5'\n"
                         "def f(x):\n    return S('')\n",
    "list_subclass_eq": "class L(list):\n    def __eq__(self, o):\n        return True\n"
                        "def f(x):\n    return L()\n",
    "dict_subclass_lies": "class D(dict):\n    def __eq__(self, o):\n        return True\n"
                          "    def items(self):\n        return iter(())\n"
                          "def f(x):\n    return D(a=1)\n",
    "mock_any": "from unittest import mock\ndef f(x):\n    return mock.ANY\n",
    "eq_returns_truthy": "class T:\n    def __eq__(self, o):\n        return [1]\n"
                         "def f(x):\n    return T()\n",
    "patched_builtins": "import builtins\nclass A:\n    def __eq__(self, o):\n        return True\n"
                        "builtins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\n"
                        "builtins.repr = lambda o: 'A()'\ndef f(x):\n    return A()\n",
    # 2. reaching the harness from inside the interpreter
    "frames_token": _FORGE_TOKEN,
    "gc_token": "import gc, os\ndef f(x):\n"
                "    tokens = [o for o in gc.get_objects() if type(o) is bytes and len(o) == 16]\n"
                "    for fd in range(3, 64):\n        for t in tokens:\n            try:\n"
                "                os.write(fd, t)\n            except OSError:\n"
                "                pass\n    os._exit(0)\n",
    "lookup_table_from_memory": _TABLE,
    "inspect_stack_table": _TABLE.replace("frame = sys._getframe()", "import inspect\n"
                                          "    frame = inspect.stack()[0].frame"),
    "traceback_frames": _TABLE.replace("frame = sys._getframe()",
                                       "try:\n        raise ValueError\n    except ValueError"
                                       " as e:\n        frame = e.__traceback__.tb_frame"),
    "frame_trace_skips_eval": "import os, sys\ndef tracer(frame, event, arg):\n"
                              "    os._exit(0)\n"
                              "def f(x):\n    caller = sys._getframe(1)\n"
                              "    caller.f_trace = tracer\n    sys.settrace(tracer)\n"
                              "    return None\n",
    "profile_hook_exits": "import os, sys\ndef prof(frame, event, arg):\n"
                          "    if event in ('c_call', 'return'):\n        os._exit(0)\n"
                          "def f(x):\n    sys.setprofile(prof)\n    return 0\n",
    "ctypes_locals_to_fast": _ATTACK_PREFIX +
        "def f(x):\n    frame = sys._getframe(1)\n"
        "    while frame is not None and 'kind' not in frame.f_locals:\n"
        "        frame = frame.f_back\n"
        "    if frame is not None:\n"
        "        frame.f_locals.update(kind='assert', check=compile('pass', 't', 'exec'),\n"
        "                              encode=lambda *a: b'V5')\n"
        "        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))\n"
        "    return None\n",
    # 3. reaching the supervisor and its report channel
    "proc_ppid_fd_forged_report": "import json, os, sys\ndef f(x):\n"
        "    line = json.dumps({'status': 'passed', 'top': True, 'value': None, 'stdout': None,"
        " 'truncated': False}).encode() + b'\\n'\n"
        "    for fd in [sys.argv[-1], '0', '1', '2']:\n        try:\n"
        "            out = os.open(f'/proc/{os.getppid()}/fd/{fd}', os.O_WRONLY)\n"
        "            os.write(out, line * 3)\n        except OSError:\n            pass\n"
        "    os._exit(0)\n",
    "proc_ppid_mem": "import os\ndef f(x):\n    try:\n"
                     "        with open(f'/proc/{os.getppid()}/mem', 'r+b') as mem:\n"
                     "            mem.seek(id('passed'))\n            mem.write(b'x')\n"
                     "    except OSError:\n        pass\n    os._exit(0)\n",
    "oversized_report": "import os, sys\ndef f(x):\n    for fd in range(3, 64):\n        try:\n"
                        "            os.write(fd, b'UV' + b'5' * (1 << 21))\n"
                        "        except OSError:\n            pass\n    os._exit(0)\n",
    "short_report": "import os\ndef f(x):\n    for fd in range(3, 64):\n        try:\n"
                    "            os.write(fd, b'U')\n        except OSError:\n            pass\n"
                    "    os._exit(0)\n",
    "kill_supervisor_after_forging": _FORGE_TOKEN.replace(
        "    os._exit(0)\n", "    os.kill(os.getppid(), 9)\n    os._exit(0)\n"),
}


@pytest.mark.parametrize("attack", sorted(VERDICT_ATTACKS))
def test_value_verdicts_cannot_be_forged(attack: str, mode: str) -> None:
    score, status = run_case(VERDICT_ATTACKS[attack], VALUE_TESTS, mode, partial=True)
    assert score == 0.0, status


def test_attack_machinery_can_pass() -> None:
    """The lookup-table attack does pass when the answers are where it looks (so the zero
    scores above are the sandbox's doing): here the answers sit in the program's own text,
    and it runs as a script (a stdio test: frames and gc are its own there; a program process
    that answers a value or assert test refuses them since issue 56)."""
    program = "NOTE = 'f(1) == 5, f(2) == 7, f(3) == 9'\n" + _TABLE + "print(f(1), f(3))\n"
    assert run_case(program, [{"input": "", "output": "5 9\n"}], "limits", partial=True)[0] \
        == 1.0


def test_judged_asserts_resist_the_token_attack(mode: str) -> None:
    """Issue 23: an assert test that is not `expr == literal` is judged in a judge process,
    so the token attack that forges an in-process verdict scores 0 there; the in-process
    fallback (a test the proxy cannot carry: a callback) is still forgeable, and counted."""
    _, result = code_reward_detailed(_FORGE_TOKEN, ["assert f(1) > 4"], LIMITS.timeout_s,
                                     mode=mode, limits=LIMITS)
    assert (result.status, result.in_process_verdicts) == ("failed", 0)
    program = _FORGE_TOKEN.replace("def f(x):", "def g(x):\n    return 0\ndef f(x):")
    _, result = code_reward_detailed(program, ["assert f(lambda: 0) > 4"], LIMITS.timeout_s,
                                     mode=mode, limits=LIMITS)
    assert (result.status, result.in_process_verdicts) == ("passed", 1)  # documented limit


_REACH = _ATTACK_PREFIX + (  # every way to the supervisor (and its parent) that worked before
    "class IOV(ctypes.Structure):\n"
    "    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
    "reached = []\n"
    "sup = os.getppid()\n"
    "with open(f'/proc/{sup}/stat') as fh:\n"
    "    grand = int(fh.read().rsplit(')', 1)[1].split()[1])\n"
    "for pid in {sup, grand} - {0}:\n"
    "    for name, flags in [('mem', os.O_RDWR), ('mem', os.O_RDONLY), ('environ', os.O_RDONLY),\n"
    "                        (f'fd/{sys.argv[-1]}', os.O_WRONLY), ('fd/0', os.O_WRONLY),\n"
    "                        ('fd/1', os.O_WRONLY), ('maps', os.O_RDONLY)]:\n"
    "        try:\n"
    "            os.close(os.open(f'/proc/{pid}/{name}', flags))\n"
    "            reached.append(f'{pid}/{name}')\n"
    "        except OSError:\n"
    "            pass\n"
    "    buf = ctypes.create_string_buffer(8)\n"
    "    local, remote = IOV(ctypes.addressof(buf), 8), IOV(id(sys.argv), 8)\n"
    "    for number in (310, 311):  # process_vm_readv / process_vm_writev (x86_64)\n"
    "        if libc.syscall(number, pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)"
    " >= 0:\n"
    "            reached.append(f'{pid}/syscall{number}')\n"
    "    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH\n"
    "        reached.append(f'{pid}/ptrace')\n"
    "    try:\n"
    "        pidfd = os.pidfd_open(pid)\n"
    "        for target in range(0, 8):  # pidfd_getfd\n"
    "            if libc.syscall(438, pidfd, target, 0) >= 0:\n"
    "                reached.append(f'{pid}/pidfd_getfd{target}')\n"
    "    except OSError:\n"
    "        pass\n")


def test_supervisor_and_trainer_are_unreachable(mode: str) -> None:
    """Measured from inside: no /proc/<supervisor or its parent>/{mem,fd,environ,maps}, no
    process_vm_readv/writev, ptrace or pidfd_getfd (supervisor non-dumpable; the trainer runs
    under another uid or outside the PID namespace). As root only (see the docs)."""
    if not AS_ROOT:
        pytest.skip("non-root: limits mode shares the trainer's uid (not claimed); bwrap "
                    "non-root not run here")
    # as a script (a stdio test): ctypes is refused in a program process that answers a value
    # or assert test (issue 56), not in a script, which is forked from the supervisor alike
    _, result = code_reward_detailed(_REACH + "print(reached)\n", [{"input": "", "output": "[]"}],
                                     LIMITS.timeout_s, partial=True, mode=mode, limits=LIMITS)
    assert result.test_status == ["passed"], result


_WALK = (  # answers from any readable data file: walk the file system, read json/py/txt files
    "import ast, os, re\n"
    "def _table():\n"
    "    found = {}\n"
    "    for root, dirs, files in os.walk('/'):\n"
    "        dirs[:] = [d for d in dirs if os.path.join(root, d) not in SKIP]\n"
    "        for name in files:\n"
    "            if name.endswith(('.jsonl', '.json', '.py', '.txt', '.yaml')):\n"
    "                try:\n"
    "                    with open(os.path.join(root, name), errors='replace') as fh:\n"
    "                        text = fh.read(1 << 20)\n"
    "                except OSError:\n"
    "                    continue\n"
    "                for m in re.finditer(r'(f\\(-?\\d+\\)) == (-?\\d+)', text):\n"
    "                    found[m.group(1)] = int(m.group(2))\n"
    "    return found\n"
    "TABLE = _table()\n"
    "def f(x):\n"
    "    return TABLE.get(f'f({x})')\n")


def _data_file(tmp_path: Path, mode: int) -> Path:
    """A training-data file that holds this test's answers (as the code task writes them)."""
    rows = [{"prompt": "f(1)=5?", "tests": VALUE_TESTS}]
    path = tmp_path / "data" / "prompts.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.chmod(path, mode)
    return path


def test_data_files_are_unreadable(mode: str, tmp_path: Path) -> None:
    """Measured from inside: the training data file (with its answers), this repository's test
    files and the host's home directories cannot be read; under bwrap the sandbox's root holds
    only what Python needs. In limits mode (root) only files closed to other users are safe."""
    if mode == "limits" and not AS_ROOT:
        pytest.skip("limits mode under the caller's own uid reads what the caller reads")
    data = _data_file(tmp_path, 0o600)
    paths = [str(data), str(Path(__file__).resolve()), "/root/.bashrc", "/etc/passwd"]
    program = (f"import os\nreadable = []\nfor p in {paths!r}:\n    try:\n"
               "        open(p, 'rb').close()\n        readable.append(p)\n    except OSError:\n"
               "        pass\n"
               "top = sorted(os.listdir('/'))\netc = sorted(os.listdir('/etc'))\n")
    tests = [f"assert readable == {[] if mode == 'bwrap' else paths[1:2] + paths[3:]!r}"]
    if mode == "bwrap":
        allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp",
                   "usr", "var"}
        tests += [f"assert set(top) <= {allowed!r}", "assert etc == ['ld.so.cache']"]
    _, result = code_reward_detailed(program, tests, LIMITS.timeout_s, partial=True, mode=mode,
                                     limits=LIMITS)
    assert result.test_status == ["passed"] * len(tests), result


def test_answers_on_disk_are_out_of_reach(mode: str, tmp_path: Path) -> None:
    """The walking attack finds nothing under bwrap (world-readable data file, host paths
    skipped only where they are too big to walk in time: /usr, /proc, /sys, /dev)."""
    if mode == "limits":
        pytest.skip("limits mode does not hide world-readable files (docs/sandbox.md)")
    _data_file(tmp_path, 0o644)
    program = "SKIP = {'/usr', '/proc', '/sys', '/dev'}\n" + _WALK
    assert run_case(program, VALUE_TESTS, mode, partial=True)[0] == 0.0
    # control: the same walk does answer from a data file that is in reach (its own /tmp)
    plant = (f"import json\nwith open('/tmp/planted.jsonl', 'w') as fh:\n"
             f"    fh.write(json.dumps({{'tests': {VALUE_TESTS!r}}}))\n")
    assert run_case(plant + program, VALUE_TESTS, mode, partial=True)[0] == 1.0
