"""Trusted supervisor that runs inside the sandbox (standard library only, never imports posttrain).

Started by :mod:`posttrain.rewards.sandbox` as ``python -I -S -B -c <this source> RESULT_FD``.
It reads one JSON payload from stdin, applies the resource limits to itself (so every
descendant inherits them), then for each test forks a fresh child that runs the program and
then that one test. The supervisor itself never executes untrusted code.

Verdict channel: each child gets a private pipe and a random 16-byte token (made per test).
The child writes ``U`` once the program's top level finished, then the token only if the test
ran to the end without raising. A test passes iff the pipe holds exactly ``U + token`` and the
child exited with status 0 before its deadline. Stdout/stderr never decide anything. The
supervisor reports to the parent on RESULT_FD, which each child closes before running code.

After every test the supervisor kills the child and everything it spawned: it is a child
subreaper (``PR_SET_CHILD_SUBREAPER``), so orphans of the program are re-parented to it and
swept (SIGKILL + reap) until none is left; see ``_sweep``.
"""

import contextlib
import json
import os
import resource
import select
import signal
import sys
import time

_TOKEN_BYTES = 16


def _prctl(option, value):
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except Exception:  # best effort: the outer layer still kills the process group
        pass


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
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGKILL)
            _reap()
            if not _others_alive(me):  # kill(-1)'s return value cannot tell us (kernel counts
                break  # tasks it failed on with errors other than EPERM)
        else:
            if pgid:
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGKILL)
            kids = _direct_children(me)
            if not kids:
                break
            for pid in kids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        _reap()
        time.sleep(0.001)
    _reap()


def _child(code, test, write_fd, token, cpu_s, result_fd):
    """Runs in the forked child: the program, then one test. Never returns."""
    # Bind everything used after the program runs *before* it runs: the program may
    # monkeypatch builtins, os, sys or this module, but not these local references.
    run, write, exit_now = exec, os.write, os._exit
    settrace, setprofile = sys.settrace, sys.setprofile
    base_exception, memory_error = BaseException, MemoryError
    try:
        os.close(result_fd)
        os.setpgid(0, 0)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
    except base_exception:  # our own set-up failed, before any untrusted code ran
        write(write_fd, b"S")
        exit_now(71)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        run(code, namespace)
        write(write_fd, b"U")
        settrace(None)
        setprofile(None)
        run(test, namespace)
    except memory_error:
        try:
            write(write_fd, b"M")
        finally:
            exit_now(1)
    except base_exception:
        exit_now(1)
    write(write_fd, token)
    exit_now(0)


def _wait_child(pid, read_fd, timeout_s):
    """Collect the child's pipe bytes and its exit; (data, status, cpu_seconds, timed_out)."""
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None  # older kernel/Python: poll every 20 ms instead
    data, reading, timed_out, done = b"", True, False, None
    while done is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            done = os.wait4(pid, 0)
            break
        watch = ([read_fd] if reading else []) + ([pidfd] if pidfd is not None else [])
        wait = remaining if pidfd is not None else min(remaining, 0.02)
        ready = select.select(watch, [], [], wait)[0]
        if reading and read_fd in ready:
            chunk = os.read(read_fd, 4096)
            reading = bool(chunk)
            if len(data) < 4096:
                data += chunk
        finished = os.wait4(pid, os.WNOHANG)
        if finished[0] == pid:
            done = finished
    if reading:  # whatever the child wrote before exiting is still in the pipe
        os.set_blocking(read_fd, False)
        with contextlib.suppress(OSError):
            data += os.read(read_fd, 4096)
    os.close(read_fd)
    if pidfd is not None:
        os.close(pidfd)
    rusage = done[2]
    return data[:4096], done[1], rusage.ru_utime + rusage.ru_stime, timed_out


def _classify(data, status, cpu_used, cpu_s, timed_out, token):
    """Test status from what the child left behind; also whether the program got past top level."""
    past_top_level = data.startswith(b"U")
    signaled = os.WIFSIGNALED(status)
    over_cpu = signaled and (
        os.WTERMSIG(status) == signal.SIGXCPU
        or (os.WTERMSIG(status) == signal.SIGKILL and cpu_used >= cpu_s)
    )
    if data == b"S":
        verdict = "sandbox_error"
    elif timed_out or over_cpu:
        verdict = "timeout"
    elif data == b"U" + token and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        verdict = "passed"
    elif b"M" in data[:2]:
        verdict = "memory"
    elif signaled:
        verdict = "crashed"
    else:
        verdict = "failed"
    return verdict, past_top_level


def _run_test(code, test, payload, result_fd):
    token = os.urandom(_TOKEN_BYTES)
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:  # e.g. EAGAIN: processes of an earlier run not yet reaped by the host
        os.close(read_fd)
        os.close(write_fd)
        return "sandbox_error", False
    if pid == 0:
        try:
            os.close(read_fd)
            _child(code, test, write_fd, token, payload["cpu_s"], result_fd)
        finally:
            os._exit(72)
    os.close(write_fd)
    data, status, cpu_used, timed_out = _wait_child(pid, read_fd, payload["timeout_s"])
    _sweep(payload["kill_all"], pid)
    return _classify(data, status, cpu_used, payload["cpu_s"], timed_out, token)


def main():
    result_fd = int(sys.argv[1])
    os.write(result_fd, b"R\n")
    payload = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die if the parent dies
    _apply_limits(payload["limits"])
    tests = payload["tests"]
    report = {"tests": [], "detail": ""}
    try:
        code = compile(payload["code"], "<program>", "exec")
        compiled = [compile(t, f"<test {i}>", "exec") for i, t in enumerate(tests)]
    except (SyntaxError, ValueError) as exc:
        report["detail"] = f"syntax error: {exc!r}"
        report["tests"] = ["failed"] * len(tests)
        compiled = []
    stopped = False
    for index, test in enumerate(compiled):
        if stopped:
            report["tests"].append("skipped")
            continue
        verdict, past_top_level = _run_test(code, test, payload, result_fd)
        report["tests"].append(verdict)
        if verdict != "passed" and (payload["stop_on_failure"] or not past_top_level):
            stopped = True  # a program that fails before its tests fails them all the same way
            where = "in the test" if past_top_level else "before the test"
            report["detail"] = f"stopped after test {index}: {verdict} {where}"
    _sweep(payload["kill_all"], 0)  # nothing may outlive the run; then report
    os.write(result_fd, (json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    main()
