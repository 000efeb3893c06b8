"""Adversarial programs (issue 4): each must score 0 (or its honest score) within its time limit,
leave no process or file behind and not harm this process - in bwrap mode and in limits-only
mode. A case that limits-only mode does not claim (docs/sandbox.md) is skipped there, with the
reason; `AS_ROOT` marks the claims that rest on dropping root to a sandbox uid."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from posttrain.rewards.sandbox import _bwrap_problem

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


def _own_children() -> list[psutil.Process]:
    """Our descendants except the math-verify workers (they live for the whole session)."""
    kids = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "math_verify" not in " ".join(child.cmdline()) and \
                    child.status() != psutil.STATUS_ZOMBIE:
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
    assert status in ALL_FAILURES


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
    score, status = run_case(program, ["assert True", "assert True"], mode, partial=True)
    assert psutil.Process().is_running()  # we are alive to assert it
    if mode == "bwrap":
        # the supervisor is PID 1 of the namespace: its processes cannot signal it, and they
        # see nothing else, so the kills do nothing and the honest score is kept
        assert (score, status) == (1.0, "passed")
    else:
        # the program can kill its supervisor (same sandbox uid), which only fails the program
        assert (score, status) == (0.0, "crashed")


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
    if mode == "limits":
        pytest.skip("limits mode does not isolate the network (docs/sandbox.md)")
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
