"""Host-side helpers of the sandbox: pick an interpreter, count and kill a uid's processes,
remove what a uid left in world-writable directories. Linux ``/proc`` only; no torch."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_PYTHON_CACHE: dict[bool, str] = {}
_PYTHON_LOCK = threading.Lock()


def probe_python(uid: int | None) -> str:
    """First interpreter the sandbox uid can run: sys.executable, then python3 on PATH.

    A root-owned ``/root/.pyenv`` interpreter, for instance, is not reachable by an
    unprivileged uid; the system ``/usr/bin/python3`` then runs the (stdlib-only) harness.
    """
    key = uid is None
    with _PYTHON_LOCK:
        if key in _PYTHON_CACHE:
            return _PYTHON_CACHE[key]
        candidates = [sys.executable, os.path.realpath(sys.executable),
                      shutil.which("python3"), "/usr/bin/python3"]
        extra = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        for candidate in dict.fromkeys(c for c in candidates if c):
            try:
                done = subprocess.run([candidate, "-I", "-S", "-c", "import resource, select"],
                                      capture_output=True, timeout=30, cwd="/", **extra)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0:
                _PYTHON_CACHE[key] = candidate
                return candidate
        raise RuntimeError(f"no Python interpreter runnable by uid {uid}: tried {candidates}; "
                           "set SandboxLimits(python=...)")


_MAGIC_CACHE: dict[str, bool] = {}


def same_bytecode(python: str) -> bool:
    """True if ``python`` reads this interpreter's marshalled code (same bytecode magic)."""
    with _PYTHON_LOCK:
        if python not in _MAGIC_CACHE:
            try:
                done = subprocess.run([python, "-I", "-S", "-c", "import importlib.util, sys; "
                                       "sys.stdout.write(importlib.util.MAGIC_NUMBER.hex())"],
                                      capture_output=True, text=True, timeout=30, cwd="/")
                theirs = done.stdout.strip() if done.returncode == 0 else ""
            except (OSError, subprocess.TimeoutExpired):
                theirs = ""
            _MAGIC_CACHE[python] = theirs == importlib.util.MAGIC_NUMBER.hex()
        return _MAGIC_CACHE[python]


def _status_fields(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}


def _uid_processes(uid: int) -> list[tuple[int, dict[str, str]]]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _status_fields(name)
        uids = fields.get("Uid", "").split()
        if uids and int(uids[0]) == uid:
            found.append((int(name), fields))
    return found


def count_user_tasks(uid: int) -> int:
    """Tasks (threads) owned by real uid ``uid`` - what RLIMIT_NPROC counts."""
    return sum(int(fields.get("Threads", "1").strip() or 1) for _, fields in _uid_processes(uid))


def kill_uid(uid: int, python: str, wait_s: float = 2.0) -> bool:
    """Kill every live process of the sandbox slot ``uid``; True once none is left alive.

    A helper running *as* ``uid`` calls ``kill(-1, SIGKILL)``, which reaches exactly that uid's
    processes and is atomic with respect to fork. Zombies left to the host's init are not waited
    for (see ``uid_is_idle``).
    """
    if uid in (0, os.getuid()):
        raise ValueError(f"refusing to kill every process of uid {uid} (the caller's or root)")
    deadline = time.monotonic() + wait_s
    while True:
        if not any(_alive(fields) for _, fields in _uid_processes(uid)):
            return True
        subprocess.run([python, "-I", "-S", "-c", "import os\ntry: os.kill(-1, 9)\n"
                        "except OSError: pass"], user=uid, group=uid, extra_groups=[],
                       capture_output=True, timeout=30, cwd="/")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def uid_is_idle(uid: int) -> bool:
    """True if ``uid`` owns no process at all, zombies included (they count for RLIMIT_NPROC)."""
    return not _uid_processes(uid)


def _alive(fields: dict[str, str]) -> bool:
    return not fields.get("State", "").strip().startswith(("Z", "X"))


def cleanup_world_writable(uid: int) -> int:
    """Remove what ``uid`` left in /tmp, /var/tmp, /dev/shm, /run/lock, at any depth.

    A process of ``uid`` can only create entries in directories it owns (removed whole) or in
    world-writable ones, so the walk descends into world-writable directories only (such as
    ``/tmp/.X11-unix``) and removes every entry ``uid`` owns there.
    """
    removed, pending = 0, list(_WORLD_WRITABLE)
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_uid != uid:
                    if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
                        pending.append(entry.path)
                    continue
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
                removed += 1
            except OSError:
                continue
    return removed


_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache",)
_PREFIX_CACHE: dict[str, list[str]] = {}


def interpreter_paths(python: str) -> list[str]:
    """Directories the interpreter ``python`` needs: its executable's directory and its
    ``sys.base_prefix`` / ``sys.base_exec_prefix`` (standard library), as real paths."""
    with _PYTHON_LOCK:
        if python not in _PREFIX_CACHE:
            done = subprocess.run([python, "-I", "-S", "-c",
                                   "import sys; print(sys.base_prefix); "
                                   "print(sys.base_exec_prefix)"],
                                  capture_output=True, text=True, timeout=30, cwd="/")
            found = [os.path.dirname(os.path.realpath(python))]
            found += [os.path.realpath(p) for p in done.stdout.split("\n") if p.strip()]
            _PREFIX_CACHE[python] = list(dict.fromkeys(found))
        return _PREFIX_CACHE[python]


def bwrap_binds(python: str) -> list[str]:
    """bubblewrap arguments that show the sandbox only what Python needs, read-only.

    ``/usr`` and the top-level library/binary directories (symlinks such as ``/lib -> usr/lib``
    stay symlinks), the dynamic loader's cache and the interpreter's own prefix when it lives
    outside ``/usr``. Nothing else of the host: no ``/work``, ``/root``, ``/home``, ``/etc``,
    ``/tmp``, ``/mnt``, ``/opt``, ``/srv``, ``/var`` (see docs/sandbox.md).
    """
    args: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _SYSTEM_FILES:
        if os.path.isfile(path):
            args += ["--ro-bind", path, path]
    for path in interpreter_paths(python):
        if not any(path == d or path.startswith(d + "/") for d in _SYSTEM_DIRS):
            args += ["--ro-bind", path, path]
    return args
