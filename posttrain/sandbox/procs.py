"""Process control of the sandbox supervisor (standard library only; runs inside the sandbox,
its source joined to the supervisor's, see :mod:`posttrain.sandbox.harness`): prctl, resource
limits, the sweep that kills what a test left, the keyring reset and the seccomp filter."""

import _signal
import os
import resource
import time


def _prctl(option, value):
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except Exception:  # best effort: the outer layer still kills the process group
        return -1


def _apply_limits(limits):
    """Limits on the supervisor, inherited by every process of the program."""
    mb = 1024 * 1024
    table = [
        (resource.RLIMIT_AS, limits["address_space_mb"] * mb),
        (resource.RLIMIT_NPROC, limits["nproc"]),
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb),
        (resource.RLIMIT_NOFILE, limits["nofile"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, limits["supervisor_cpu_s"]),
    ]
    for which, value in table:
        resource.setrlimit(which, (value, value))


def _direct_children(me):
    """Pids whose parent is ``me`` (includes re-parented orphans and zombies)."""
    kids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == me:
            kids.append(int(name))
    return kids


def _others_alive(me):
    """True while a process of our uid other than us and init exists (zombies count)."""
    uid = str(os.getuid()).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (me, 1):
            continue
        try:
            with open("/proc/" + name + "/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if line.split()[1] == uid:
                            return True
                        break
        except OSError:
            continue
    return False


def _reap():
    """Reap every child that has exited (we are the subreaper: orphans included)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _quietly(call, *args):
    """``call(*args)``, an ``OSError`` ignored (what ``contextlib.suppress`` does, without its
    imports: ~3 ms a run)."""
    try:
        return call(*args)
    except OSError:
        return None


def _sweep(kill_all, pgid):
    """Kill every process the program left, then reap them.

    ``kill_all``: we are alone with the program in a PID namespace or under a uid of our own,
    so ``kill(-1, SIGKILL)`` reaches exactly the program's processes (never us, never init) and
    is atomic with respect to fork - a fork bomb cannot outrun it. Otherwise (limits mode under
    a shared uid) kill the test's process group and our direct children until none is left.
    """
    me = os.getpid()
    for _ in range(5000):
        if kill_all:
            _quietly(os.kill, -1, _signal.SIGKILL)
            _reap()
            if not _others_alive(me):  # kill(-1)'s return value cannot tell us (kernel counts
                break  # tasks it failed on with errors other than EPERM)
        else:
            if pgid:
                _quietly(os.killpg, pgid, _signal.SIGKILL)
            kids = _direct_children(me)
            if not kids:
                break
            for pid in kids:
                _quietly(os.kill, pid, _signal.SIGKILL)
        _reap()
        time.sleep(0.001)
    _reap()


def _clear_keyrings():
    """Empty the uid's user and user-session keyrings (``keyctl(KEYCTL_CLEAR)``; they outlive
    processes). x86_64 and aarch64 syscall numbers; elsewhere a no-op."""
    number = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
    if number is None:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
            libc.syscall(number, 7, keyring)  # KEYCTL_CLEAR
    except Exception:
        pass


# seccomp filter: (audit arch, sysinfo's number, lowest number of another ABI to refuse)
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 99, 0x40000000), "aarch64": (0xC00000B7, 179, 0xFFFFFFFF)}


def _deny_sysinfo():
    """Make ``sysinfo()`` fail with ``ENOSYS`` in this process and every process it forks (a
    seccomp filter, which cannot be removed): its free and shared memory figures are the
    host's, a channel between concurrent runs. Calls of another ABI (x32, i386) fail the same
    way. Best effort: False where it cannot be installed (other machines, no seccomp)."""
    known = _SECCOMP_ARCH.get(os.uname().machine)
    if known is None:
        return False
    arch, number, other_abi = known
    errno_enosys, allow = 0x00050000 | 38, 0x7FFF0000
    program = [  # (code, jump if true, jump if false, k)
        (0x20, 0, 0, 4),  # load the architecture
        (0x15, 1, 0, arch),  # native: go on
        (0x06, 0, 0, errno_enosys),
        (0x20, 0, 0, 0),  # load the system call number
        (0x35, 2, 0, other_abi),  # another ABI: refuse
        (0x15, 1, 0, number),  # sysinfo: refuse
        (0x06, 0, 0, allow),
        (0x06, 0, 0, errno_enosys),
    ]
    try:
        import ctypes
        import struct

        code = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
        instructions = ctypes.create_string_buffer(code, len(code))
        fprog = ctypes.create_string_buffer(  # struct sock_fprog {u16 len; filter *ptr}
            struct.pack("@HP", len(program), ctypes.addressof(instructions)))
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return libc.prctl(22, 2, fprog, 0, 0) == 0  # SECCOMP_MODE_FILTER
    except Exception:
        return False

