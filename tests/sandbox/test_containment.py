"""Containment (issue 23): every writable mount of the sandbox is size-capped, and nothing a
run leaves in SysV IPC, POSIX message queues, the keyring or a world-writable directory below
/tmp reaches a later run (bwrap: namespaces per run; limits as root: an IPC namespace per run,
keyrings cleared, /tmp swept at any depth)."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from pathlib import Path

import pytest

from posttrain.rewards import SandboxLimits, SandboxUnavailableError, run_sandboxed
from posttrain.sandbox import jail as sandbox_module
from tests.sandbox.test_adversarial_programs import (
    AS_ROOT,
    _own_children,
    mode,
)

__all__ = ["mode"]

LIMITS = SandboxLimits(timeout_s=3.0, tmpfs_mb=8)

_MOUNTS = (  # rw mounts that hold data and have no size cap at or under tmpfs_mb
    "import os, stat\n"
    "def uncapped(cap_kib):\n"
    "    bad = []\n"
    "    for line in open('/proc/self/mountinfo'):\n"
    "        left, right = line.split(' - ')\n"
    "        point, opts = left.split()[4], left.split()[5].split(',')\n"
    "        fstype, extra = right.split()[0], right.split()[2].split(',')\n"
    "        if 'rw' not in opts or fstype == 'proc':\n"
    "            continue\n"
    "        if stat.S_ISCHR(os.stat(point).st_mode):\n"
    "            continue  # a device node bound in (/dev/null): no storage behind it\n"
    "        sizes = [o[5:] for o in extra if o.startswith('size=')]\n"
    "        if fstype != 'tmpfs' or not sizes or int(sizes[0].rstrip('k')) > cap_kib:\n"
    "            bad.append((point, fstype, sizes))\n"
    "    return bad\n"
    "def fill(path):\n"
    "    try:\n"
    "        with open(path, 'wb') as fh:\n"
    "            for _ in range(64):\n"
    "                fh.write(b'x' * (1 << 20))\n"
    "    except OSError:\n"
    "        pass\n"
    "    try:\n"
    "        return os.path.getsize(path) >> 20\n"
    "    except OSError:\n"
    "        return 0\n")


def test_every_writable_mount_is_capped(mode: str) -> None:
    if mode == "limits":
        pytest.skip("limits mode has no mounts of its own (docs/sandbox.md)")
    tests = ["assert uncapped(8 * 1024) == []",
             "assert fill('/dev/big') == 0",  # /dev is read-only
             "assert fill('/dev/shm/big') <= 8 and fill('/tmp/big') <= 8",
             "assert fill('/var/tmp/big') <= 8",
             "assert open('/dev/urandom', 'rb').read(4) and open('/dev/null', 'w').write('x')"]
    result = run_sandboxed(_MOUNTS, tests, limits=LIMITS, mode=mode)
    assert result.test_status == ["passed"] * len(tests), result.stdout
    assert _own_children() == []


_IPC = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.shmat.restype = ctypes.c_void_p\n"
    "KEY, NAME = 0x5EED23, b'/posttrain-answers'\n"
    "def leave():\n"
    "    made = []\n"
    "    shm = libc.shmget(KEY, 4096, 0o1666)\n"
    "    if shm >= 0:\n"
    "        ctypes.memmove(libc.shmat(shm, None, 0), b'7', 1)\n"
    "        made.append('shm')\n"
    "    if libc.msgget(KEY, 0o1666) >= 0:\n"
    "        made.append('msg')\n"
    "    if libc.semget(KEY, 1, 0o1666) >= 0:\n"
    "        made.append('sem')\n"
    "    if libc.mq_open(NAME, os.O_CREAT | os.O_RDWR, 0o666, None) >= 0:\n"
    "        made.append('mq')\n"
    "    if KEYS and libc.syscall(248, b'user', b'posttrain-answers', b'7', 1, -4) > 0:\n"
    "        made.append('key')\n"
    "    if WORLD:\n"
    "        with open(os.path.join(WORLD, 'answers'), 'w') as fh:\n"
    "            fh.write('7')\n"
    "        made.append('file')\n"
    "    return made\n"
    "def found():\n"
    "    seen = []\n"
    "    if libc.shmget(KEY, 0, 0) >= 0:\n"
    "        seen.append('shm')\n"
    "    if libc.msgget(KEY, 0) >= 0:\n"
    "        seen.append('msg')\n"
    "    if libc.semget(KEY, 1, 0) >= 0:\n"
    "        seen.append('sem')\n"
    "    if libc.mq_open(NAME, os.O_RDONLY) >= 0:\n"
    "        seen.append('mq')\n"
    "    if KEYS and libc.syscall(250, 10, -4, b'user', b'posttrain-answers', 0) > 0:\n"
    "        seen.append('key')\n"
    "    if WORLD and os.path.exists(os.path.join(WORLD, 'answers')):\n"
    "        seen.append('file')\n"
    "    return seen\n")


def test_nothing_a_run_leaves_reaches_the_next(mode: str) -> None:
    if mode == "limits" and not AS_ROOT:
        pytest.skip("limits mode under the caller's own uid is not protected (docs)")
    world = None
    if mode == "limits":  # a world-writable directory below /tmp's top level
        world = tempfile.mkdtemp(prefix="posttrain-world-", dir="/tmp")
        os.chmod(world, 0o1777)
    try:
        keys = platform.machine() == "x86_64"
        program = f"WORLD = {world!r}\nKEYS = {keys}\n" + _IPC
        kinds = ["shm", "msg", "sem", "mq"] + ["key"] * keys + ["file"] * bool(world)
        # control: within one test the objects exist (so 'found nothing' below means something)
        # scripts (stdio tests): ctypes is refused in a program process that answers a value or
        # assert test since issue 56, not in a script, forked from the supervisor alike
        first = run_sandboxed(program + "print(leave(), found())\n",
                              [{"input": "", "output": f"{kinds} {kinds}"}], limits=LIMITS,
                              mode=mode)
        assert first.status == "passed", first.stdout
        later = run_sandboxed(program + "print(found())\n", [{"input": "", "output": "[]"}],
                              limits=LIMITS, mode=mode)
        assert later.status == "passed", later.stdout
        assert not world or os.listdir(world) == []
    finally:
        if world:
            shutil.rmtree(world, ignore_errors=True)


def test_limits_as_root_refuses_without_an_ipc_namespace(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    if not AS_ROOT:
        pytest.skip("only root runs limits mode under a sandbox uid")
    monkeypatch.setattr(sandbox_module.shutil, "which",
                        lambda name: None if name in ("unshare", "setpriv") else "/bin/" + name)
    with pytest.raises(SandboxUnavailableError, match="needs unshare and setpriv"):
        run_sandboxed("x = 1", ["assert x == 1"], mode="limits")
    assert Path("/proc/self").exists()
