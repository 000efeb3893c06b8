"""Run untrusted Python with tests in a sandbox: bubblewrap + resource limits + process sweep.

``run_sandboxed(code, tests, limits=..., mode=...)`` starts the supervisor
(:mod:`posttrain.sandbox.harness`) in a fresh interpreter, sends it the program and the tests
(:mod:`posttrain.sandbox.io`), judges each answer here, outside the sandbox
(:mod:`posttrain.sandbox.tests`), and returns a :class:`SandboxResult`.

* ``bwrap``: read-only system directories only, private size-capped tmpfs, every namespace
  unshared, ``--die-with-parent``, ``--clearenv``; killing bubblewrap kills the whole run.
* ``limits``: the same resource limits and sweep, no file-system or network isolation.
* ``strict`` / ``bwrap`` refuse without a working bubblewrap; ``auto`` falls back to limits.
In every mode: CPU, memory, process, file-size and file limits on every process, wall-clock
deadlines per test and per run, capped output, and (as root) a unique unprivileged uid per slot.
More: docs/sandbox.md, "Module notes", posttrain.sandbox.jail.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import marshal
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.sandbox.host import (
    bwrap_binds,
    cleanup_world_writable,
    count_user_tasks,
    kill_uid,
    probe_python,
    same_bytecode,
    uid_is_idle,
)
from posttrain.sandbox.io import Exchange, ProtocolError, exchange
from posttrain.sandbox.tests import CodeTest, CompareOptions, judge, parse_test
from posttrain.sandbox.wire import dumps_frame

logger = logging.getLogger(__name__)

STATUSES = ("passed", "failed", "timeout", "memory", "crashed", "sandbox_error")
_MODES = {"auto": "auto", "bwrap": "bwrap", "strict": "bwrap", "limits": "limits"}
_PARENT_ONLY = re.compile(r"^# <parent-only>.*?^# </parent-only>\n", re.DOTALL | re.MULTILINE)


def _sandbox_source() -> str:
    """The supervisor's source: wire, guard, views, program, judge, procs, harness, without their
    parent-only imports."""
    parts = [Path(__file__).with_name(name).read_text() for name in
             ("wire.py", "guard.py", "views.py", "program.py", "judge.py", "procs.py",
              "harness.py")]
    return "\n".join(_PARENT_ONLY.sub("", part) for part in parts)


_HARNESS_SOURCE = _sandbox_source()
# Compiling the supervisor's source costs ~6 ms per run; when the sandbox's interpreter reads
# our bytecode, the parent compiles it once and a bootstrap loads it from the command pipe.
_BOOTSTRAP = ("import marshal, os, sys\nsize, data = int(sys.argv[1]), b''\n"
              "while len(data) < size:\n"
              "    chunk = os.read(0, size - len(data))\n"
              "    if not chunk:\n        sys.exit(70)\n"
              "    data += chunk\n"
              "exec(marshal.loads(data))\n")
_COMPILED: dict[str, bytes] = {}


def _compiled(source: str) -> bytes:
    """Marshalled code of the supervisor ``source`` (cached per source text)."""
    if source not in _COMPILED:
        _COMPILED[source] = marshal.dumps(compile(source, "<supervisor>", "exec"))
    return _COMPILED[source]
_STARTUP_S = 10.0  # interpreter + bubblewrap start-up allowance for the whole-run deadline


class SandboxUnavailableError(RuntimeError):
    """The requested sandbox mode cannot run here (e.g. ``strict`` without bubblewrap)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run (defaults in brackets; docs/sandbox.md)."""

    timeout_s: float = 5.0
    """Wall-clock limit per test [5 s]; the CPU limit per test is ``ceil(timeout_s)`` seconds."""
    address_space_mb: int = 1024
    """RLIMIT_AS of every process [1024 MiB]."""
    nproc: int = 32
    """RLIMIT_NPROC: processes + threads of the run [32]."""
    file_size_mb: int = 16
    """RLIMIT_FSIZE: largest file the program may write [16 MiB]."""
    nofile: int = 64
    """RLIMIT_NOFILE: open file descriptors per process [64]."""
    tmpfs_mb: int = 64
    """Size of each private tmpfs in bwrap mode [64 MiB]."""
    max_output_bytes: int = 65536
    """Stdout and stderr are each kept up to this many bytes [64 KiB]; the rest is drained.
    Also the most stdout a stdin/stdout test may print (more fails that test)."""
    max_value_bytes: int = 65536
    """A value test's value, or an answer to the judge, may take ``4 x max_value_bytes + 1 KiB``
    in wire form [64 KiB]; a larger one fails that test."""
    uid_base: int = 200000
    """When running as root, slot ``k`` runs as uid/gid ``uid_base + k`` [200000]."""
    python: str | None = None
    """Interpreter inside the sandbox [first of sys.executable, python3 that the uid can run]."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "address_space_mb", "nproc", "file_size_mb", "nofile",
                     "tmpfs_mb", "max_output_bytes", "max_value_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """Outcome of one run. ``status`` is the first non-passing test's status (or ``passed``)."""

    status: str
    tests_passed: int
    tests_total: int
    test_status: list[str] = field(default_factory=list)
    detail: str = ""
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    mode: str = ""
    test_kinds: list[str] = field(default_factory=list)
    """``value`` / ``stdio`` / ``assert`` per test (:mod:`posttrain.sandbox.tests`)."""
    in_process_verdicts: int = 0
    """Assert tests judged inside the program's interpreter after all (the judge could not
    carry what they need; forgeable)."""


_INFRA = ("cannot start the sandbox", "sandbox did not start", "bad report")
_HOW = {"failed": "raised an exception or exited with a non-zero status",
        "timeout": "ran past its time limit of {t:g} s", "memory": "ran out of memory",
        "crashed": "was killed by a signal", "sandbox_error": "broke the sandbox's protocol"}


def script_answer(result: SandboxResult, timeout_s: float) -> str:
    """What a script run (``run_sandboxed(code)``, no tests) says to the model that wrote it:
    its stdout, and when it did not finish cleanly a last line saying how (a program's failure
    is an answer, never an exception). Raises RuntimeError only when the sandbox itself did not
    run (it could not start, or its report broke): that is the tool's failure, not the
    program's."""
    if result.status == "passed":
        return result.stdout
    if result.status == "sandbox_error" and result.detail.startswith(_INFRA):
        raise RuntimeError(f"the sandbox did not run: {result.detail[-300:]}")
    how = _HOW.get(result.status, result.status).format(t=timeout_s)
    out = result.stdout if result.stdout.endswith("\n") or not result.stdout \
        else result.stdout + "\n"
    return f"{out}error: the program {how}"


class _Slots:
    """Slot numbers for concurrent runs; with ``lock_dir`` a slot is also locked across
    processes (``flock``), so two trainers on one machine never share a sandbox uid."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used: dict[int, int | None] = {}  # slot -> lock file descriptor

    def acquire(self, lock_dir: str | None, usable: Callable[[int], bool]) -> int:
        """Lowest free slot that ``usable`` accepts (e.g. its uid has no zombies left)."""
        with self._lock:
            slot = 0
            while True:
                if slot not in self._used and usable(slot):
                    fd = _try_lock(lock_dir, slot) if lock_dir else None
                    if lock_dir is None or fd is not None:
                        self._used[slot] = fd
                        return slot
                slot += 1

    def release(self, slot: int) -> None:
        with self._lock:
            fd = self._used.pop(slot, None)
        if fd is not None:
            os.close(fd)  # closing drops the flock


def _try_lock(lock_dir: str, slot: int) -> int | None:
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, f"slot-{slot}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


_SLOTS = _Slots()
_PROBE_LOCK = threading.Lock()
_BWRAP_OK: dict[bool, str | None] = {}  # as_root -> None if bwrap works, else the reason
_WARNED: set[str] = set()


# A read-only /dev of 64 KiB holding only these devices (bwrap's own --dev is a writable tmpfs
# of half the RAM); /dev/shm is a size-capped tmpfs of its own (_bwrap_argv).
_DEVICES = ("null", "zero", "full", "random", "urandom")
_MINIMAL_DEV = (
    "--size", "65536", "--tmpfs", "/dev",
    *[arg for name in _DEVICES for arg in ("--dev-bind", f"/dev/{name}", f"/dev/{name}")],
    "--symlink", "/proc/self/fd", "/dev/fd",
    *[arg for number, name in enumerate(("stdin", "stdout", "stderr"))
      for arg in ("--symlink", f"/proc/self/fd/{number}", f"/dev/{name}")],
    "--dir", "/dev/shm",
    "--remount-ro", "/dev",
)


# host-wide counters of memory and load in /proc: concurrent runs could signal each other
# through them (a run's tmpfs pages show in `Shmem`), so each run sees them empty
_HOST_COUNTERS = ("meminfo", "vmstat", "zoneinfo", "buddyinfo", "pagetypeinfo", "slabinfo",
                  "swaps", "stat", "loadavg", "pressure/memory", "pressure/cpu", "pressure/io")
_EMPTY_FILE: list[str] = []


def _masked_counters() -> list[str]:
    """bubblewrap arguments that bind an empty file over each host-wide counter."""
    if not _EMPTY_FILE:
        folder = tempfile.mkdtemp(prefix="posttrain-sandbox-empty-")
        os.chmod(folder, 0o755)
        path = os.path.join(folder, "empty")
        with open(path, "wb"):
            pass
        os.chmod(path, 0o444)
        _EMPTY_FILE.append(path)
        atexit.register(shutil.rmtree, folder, True)
    return [arg for name in _HOST_COUNTERS if os.path.exists(f"/proc/{name}")
            for arg in ("--ro-bind", _EMPTY_FILE[0], f"/proc/{name}")]


def _bwrap_argv(limits: SandboxLimits, python: str) -> list[str]:
    size = str(limits.tmpfs_mb * 1024 * 1024)
    return [
        shutil.which("bwrap") or "bwrap",
        *bwrap_binds(python),
        *_MINIMAL_DEV,
        "--proc", "/proc",
        *_masked_counters(),
        "--size", size, "--tmpfs", "/tmp",
        "--size", size, "--tmpfs", "/var/tmp",
        "--size", size, "--tmpfs", "/dev/shm",
        "--remount-ro", "/",
        "--chdir", "/tmp",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--as-pid-1",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
        "--setenv", "HOME", "/tmp",
        "--setenv", "TMPDIR", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
        "--",
    ]


def _user_kwargs(uid: int | None) -> dict:
    if uid is None:
        return {}
    return {"user": uid, "group": uid, "extra_groups": []}


def _bwrap_problem(as_root: bool, uid: int | None) -> str | None:
    """None if bubblewrap runs a process here, else why not (cached per privilege level)."""
    with _PROBE_LOCK:
        if as_root not in _BWRAP_OK:
            if shutil.which("bwrap") is None:
                _BWRAP_OK[as_root] = ("bwrap not found on PATH "
                                      "(Debian/Ubuntu: apt-get install bubblewrap)")
            else:
                python = os.path.realpath(probe_python(uid))
                argv = _bwrap_argv(SandboxLimits(), python) + [python, "-I", "-S", "-c", ""]
                try:
                    done = subprocess.run(argv, capture_output=True, timeout=30,
                                          **_user_kwargs(uid))
                    ok = done.returncode == 0
                    reason = None if ok else done.stderr.decode(errors="replace").strip()
                except (OSError, subprocess.TimeoutExpired) as exc:
                    reason = repr(exc)
                _BWRAP_OK[as_root] = reason and f"bwrap failed to start a sandbox: {reason}"
        return _BWRAP_OK[as_root]


def _resolve_mode(mode: str, as_root: bool, uid: int | None) -> str:
    if mode not in _MODES:
        raise ValueError(f"unknown sandbox mode {mode!r}; valid modes: {sorted(_MODES)}")
    wanted = _MODES[mode]
    if wanted == "limits":
        return "limits"
    problem = _bwrap_problem(as_root, uid)
    if problem is None:
        return "bwrap"
    if wanted == "bwrap":
        raise SandboxUnavailableError(f"sandbox mode {mode!r} needs bubblewrap: {problem}")
    if "limits" not in _WARNED:
        _WARNED.add("limits")
        logger.warning("%s; running code with resource limits only: file-system and network "
                       "isolation are OFF (set sandbox mode 'strict' to refuse)", problem)
    return "limits"


def _run_message(code: str, n_tests: int, limits: SandboxLimits, nproc: int,
                 kill_all: bool) -> bytes:
    cpu_s = max(1, math.ceil(limits.timeout_s))
    harness_limits = {
        "address_space_mb": limits.address_space_mb,
        "nproc": nproc,
        "file_size_mb": limits.file_size_mb,
        "nofile": limits.nofile,
        "supervisor_cpu_s": (cpu_s + 2) * max(1, n_tests) + 10,
    }
    body = {"code": code, "timeout_s": limits.timeout_s, "cpu_s": cpu_s, "kill_all": kill_all,
            "limits": harness_limits, "max_value_bytes": limits.max_value_bytes,
            "max_stdout_bytes": limits.max_output_bytes}
    return json.dumps(body).encode()


class _Judge:
    """Judges each answer outside the sandbox (``code_tests.judge``) and decides early stops."""

    def __init__(self, tests: list[CodeTest], options: CompareOptions,
                 stop_on_failure: bool) -> None:
        self.tests, self.options, self.stop_on_failure = tests, options, stop_on_failure
        self.status: list[str] = []
        self.in_process: list[bool] = []
        self.detail = ""

    def __call__(self, index: int, response: dict) -> bool:
        test = self.tests[index]
        if response["in_process"] and test.kind != "assert":
            raise ProtocolError(f"an in-process verdict for a {test.kind} test")
        status = judge(test, response, self.options)
        self.status.append(status)
        self.in_process.append(response["in_process"] and status != "sandbox_error")
        if status == "passed":
            return True
        top_failed = not response["top"] and test.kind != "stdio"
        if self.stop_on_failure or top_failed:
            where = "before the test" if top_failed else "in the test"
            self.detail = f"stopped after test {index}: {status} {where}"
            return False
        return True


def _outcome(judged: _Judge, done: Exchange, n_tests: int) -> tuple[str, list[str], str]:
    """(status, per-test statuses, detail) of a finished exchange."""
    if done.error:
        return "sandbox_error", ["sandbox_error"] * n_tests, f"bad report: {done.error}"
    if not done.started:
        tail = done.stderr.decode(errors="replace")[-500:]
        return "sandbox_error", ["sandbox_error"] * n_tests, f"sandbox did not start: {tail}"
    statuses = list(judged.status)
    detail = judged.detail
    if len(statuses) < n_tests:
        if done.stopped_early:
            statuses += ["skipped"] * (n_tests - len(statuses))
        else:  # the supervisor died or the run's deadline passed before every answer
            lost = "timeout" if done.timed_out else "crashed"
            detail = f"no answer for test {len(statuses)} ({lost})"
            statuses += [lost] * (n_tests - len(statuses))
    failing = [t for t in statuses if t not in ("passed", "skipped")]
    return (failing[0] if failing else "passed"), statuses, detail


def _launch(mode: str, limits: SandboxLimits, uid: int | None, workdir: str | None,
            result_w: int, tests_r: int) -> tuple[subprocess.Popen, bytes]:
    """The started supervisor and the bytes to send before the run (its compiled code, or
    nothing when it was given as source)."""
    python = limits.python or probe_python(uid)
    if mode == "bwrap":
        python = os.path.realpath(python)  # only the interpreter's own directories are bound
    preamble = _compiled(_HARNESS_SOURCE) if same_bytecode(python) else b""
    head = [_BOOTSTRAP, str(len(preamble))] if preamble else [_HARNESS_SOURCE]
    command = [python, "-I", "-S", "-B", "-u", "-c", *head, str(result_w), str(tests_r)]
    user = _user_kwargs(uid)
    if mode == "bwrap":
        command = _bwrap_argv(limits, python) + command
        env = {}
    else:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir),
               "TMPDIR": str(workdir), "LANG": "C.UTF-8"}
        if uid is not None:  # a fresh IPC namespace, then drop root (_ipc_wrapper)
            command, user = _ipc_wrapper(uid) + command, {}
        else:  # not root: namespaces of a user namespace of our own, where the kernel allows
            command = _own_namespaces() + command
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        pass_fds=(result_w, tests_r), start_new_session=True, env=env, cwd=workdir, **user,
    ), preamble


def _ipc_wrapper(uid: int) -> list[str]:
    """``unshare --ipc --net`` then ``setpriv`` to the sandbox uid (util-linux): in limits mode
    as root each run gets an IPC namespace of its own, so SysV shared memory, message queues,
    semaphores and POSIX message queues die with the run, and a network namespace of its own
    (no interface up: no network, not even the host's localhost, e.g. a vLLM server).
    Without both tools limits mode refuses to run as root (SandboxUnavailableError)."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if not (unshare and setpriv):
        raise SandboxUnavailableError(
            "limits mode as root needs unshare and setpriv (util-linux) so that nothing a run "
            "leaves in SysV IPC or POSIX message queues reaches a later run; install "
            "util-linux or bubblewrap, or run the trainer as a non-root user")
    return [unshare, "--ipc", "--net", "--", setpriv, f"--reuid={uid}", f"--regid={uid}",
            "--clear-groups", "--"]


_NAMESPACES: list[list[str]] = []  # the probed prefix of _own_namespaces (once a process)


def _own_namespaces() -> list[str]:
    """Limits mode as a non-root user: ``unshare --user --map-current-user --ipc --net`` when
    the kernel lets an unprivileged user make a user namespace (probed once): a network
    namespace with no interface up (the program reaches no server, not even the host's
    localhost: a local vLLM server's ``/collective_rpc``) and an IPC namespace of its own; the
    uid stays the caller's and holds no capability there. Otherwise ``[]`` and one warning
    that the run has the host's network."""
    if not _NAMESPACES:
        unshare = shutil.which("unshare")
        argv = [unshare, "--user", "--map-current-user", "--ipc", "--net", "--"] if unshare \
            else []
        try:
            ok = bool(argv) and subprocess.run(argv + ["true"], capture_output=True,
                                               timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if not ok:
            logger.warning("sandbox limits mode as a non-root user: no user namespace here "
                           "(unshare --user --net failed), so programs and the python tool "
                           "have the host's network; install bubblewrap or run as root")
            argv = []
        _NAMESPACES.append(argv)
    return _NAMESPACES[0]


def _nproc_limit(limits: SandboxLimits, mode: str, uid: int | None) -> int:
    """RLIMIT_NPROC counts every task of the (namespaced) uid; add what a shared uid already has."""
    if uid is not None or mode == "bwrap":
        return limits.nproc  # a uid of our own, or a fresh user namespace: only this run counts
    return count_user_tasks(os.getuid()) + limits.nproc


def run_sandboxed(code: str, tests: Sequence[str | dict | CodeTest] | None = None, *,
                  limits: SandboxLimits | None = None, mode: str = "auto",
                  stop_on_failure: bool = False,
                  compare: CompareOptions | Mapping[str, Any] | None = None) -> SandboxResult:
    """Run ``code`` then each test in its own fresh process; judge the tests outside it.

    A test is an assert snippet or a ``{"input": str, "output": str}`` dict
    (:mod:`posttrain.sandbox.tests`: ``assert <expr> == <literal>`` is compared here with
    ``compare`` options, stdin/stdout tests too; other snippets are judged in-process).
    Without ``tests`` the program alone runs once and passes if it finishes without raising.
    ``stop_on_failure`` skips the remaining tests after the first one that does not pass.
    """
    limits = limits or SandboxLimits()
    parsed = [parse_test(t, i) for i, t in enumerate(tests)] if tests else [parse_test("")]
    options = CompareOptions.from_any(compare)
    as_root = os.geteuid() == 0
    lock_dir = os.path.join(tempfile.gettempdir(), "posttrain-sandbox-slots") if as_root else None
    slot = _SLOTS.acquire(lock_dir, lambda k: not as_root or uid_is_idle(limits.uid_base + k))
    uid = limits.uid_base + slot if as_root else None
    started = time.monotonic()
    try:
        resolved = _resolve_mode(mode, as_root, uid)
        return _run_in_slot(code, parsed, limits, resolved, uid,
                            _Judge(parsed, options, stop_on_failure), started)
    finally:
        _SLOTS.release(slot)


def _run_in_slot(code: str, tests: list[CodeTest], limits: SandboxLimits, mode: str,
                 uid: int | None, judged: _Judge, started: float) -> SandboxResult:
    workdir = None
    if mode == "limits" and uid is not None:
        kill_uid(uid, limits.python or probe_python(uid))  # leftovers of a crashed process
    if mode == "limits":
        workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
        if uid is not None:
            os.chown(workdir, uid, uid)
    kill_all = mode == "bwrap" or uid is not None  # alone in a PID namespace or a uid
    run = _run_message(code, len(tests), limits, _nproc_limit(limits, mode, uid), kill_all)
    messages = [json.dumps(t.sandbox_message(i)).encode() for i, t in enumerate(tests)]
    # assert tests' sources go to the judge processes alone, on a pipe the supervisor never
    # reads (so no program process, forked from it, ever holds an expected value)
    sources = b"".join(dumps_frame({"index": i, "source": t.source})
                       for i, t in enumerate(tests) if t.kind == "assert")
    line_cap = 8 * (limits.max_value_bytes + limits.max_output_bytes) + 1024
    result_r, result_w = os.pipe()
    tests_r, tests_w = os.pipe()
    proc, done = None, Exchange(timed_out=True)
    try:
        try:
            proc, preamble = _launch(mode, limits, uid, workdir, result_w, tests_r)
        except OSError as exc:
            return SandboxResult("sandbox_error", 0, len(tests), ["sandbox_error"] * len(tests),
                                 f"cannot start the sandbox: {exc!r}", mode=mode,
                                 duration_s=time.monotonic() - started)
        finally:
            os.close(result_w)
            os.close(tests_r)
        deadline = started + _STARTUP_S + len(tests) * (limits.timeout_s + 1.0)
        done = exchange(proc, result_r, preamble + run, messages, judged, deadline,
                        limits.max_output_bytes, line_cap, sources=(tests_w, sources),
                        per_answer_s=_STARTUP_S / 2 + 2 * limits.timeout_s)
    finally:
        os.close(result_r)
        os.close(tests_w)
        _cleanup(proc, mode, uid, workdir, limits,
                 graceful=not (done.timed_out or done.error or done.stopped_early))
    status, test_status, detail = _outcome(judged, done, len(tests))
    in_process = sum(judged.in_process)
    return SandboxResult(
        status=status, tests_passed=test_status.count("passed"), tests_total=len(tests),
        test_status=test_status, detail=detail, stdout=done.stdout.decode(errors="replace"),
        stderr=done.stderr.decode(errors="replace"), duration_s=time.monotonic() - started,
        mode=mode, test_kinds=[t.kind for t in tests], in_process_verdicts=in_process,
    )


def _cleanup(proc: subprocess.Popen | None, mode: str, uid: int | None,
             workdir: str | None, limits: SandboxLimits, graceful: bool) -> None:
    """Nothing of the run may survive it: process group, uid sweep, temporary files."""
    if proc is not None and graceful:
        # a supervisor that reported exits by itself; let bubblewrap unwind its namespace
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)
    if proc is not None and mode == "bwrap" and proc.poll() is None:
        # kill bubblewrap's in-namespace init first: the kernel then kills the whole namespace
        # and the outer bwrap reaps it (killing the outer first would orphan a zombie)
        for child in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)
    if proc is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
    if mode == "limits" and uid is not None:
        kill_uid(uid, limits.python or probe_python(uid))
        cleanup_world_writable(uid)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc/<pid>/task/<pid>/children``)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []
