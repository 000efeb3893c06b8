"""Sandbox supervisor (standard library only, never imports posttrain; runs inside the sandbox).

Started by :mod:`posttrain.sandbox.jail` as ``python -I -S -B -u -c <wire + judge + procs +
this source> RESULT_FD TESTS_FD``. It makes itself non-dumpable, applies the resource limits
to itself and talks to the parent: the run and one test per line on stdin, the assert tests'
sources framed on TESTS_FD (read by judge processes only), one JSON answer per test on
RESULT_FD.

Per test: ``value`` forks a program process that answers one call in wire form; ``stdio``
runs the program as a script; ``assert`` forks a program process and then a judge process
(:mod:`.judge`), which alone reads the test's source, so no process of the program ever held
an expected value. After every test the supervisor kills everything the program started
(``_sweep``; it is a child subreaper) before it answers.
More: docs/sandbox.md, "Module notes", posttrain.sandbox.harness.
"""

import _signal  # C modules, not signal.py (enum) or socket.py; and no json or contextlib:
import _socket  # their imports would cost ~7 ms a run
import _thread
import os
import resource
import select
import sys
import time
from _queue import SimpleQueue
from _weakref import ref as weakref_ref
from itertools import chain, starmap

# <parent-only> (removed from the sandbox's source, which starts with wire's and judge's)
from posttrain.sandbox.guard import guard_program
from posttrain.sandbox.judge import Link, judge_test, program_names
from posttrain.sandbox.procs import _apply_limits, _clear_keyrings, _deny_sysinfo, _prctl, _sweep
from posttrain.sandbox.program import private_world
from posttrain.sandbox.wire import (
    _ENCODE,
    WireError,
    dumps_frame,
    json_codec,
    read_frame,
    split_frames,
    write_frame,
)

# </parent-only>

_TOKEN_BYTES = 16
_COMMAND = json_codec(float)[1]  # reads the parent's commands; wire's _ENCODE our answers
_SUPERVISOR_FDS = []  # the result and tests pipes: every child closes them first
# standard-library modules programs often import, loaded once before any fork when the
# program's code names them (not again in each test's program process); none keeps state made
# per process (random, tempfile, uuid are not here)
_PRELOAD = frozenset(("abc", "bisect", "collections", "contextlib", "copy", "dataclasses",
                      "datetime", "decimal", "enum", "fractions", "functools", "heapq",
                      "itertools", "json", "math", "numbers", "operator", "re", "string",
                      "textwrap", "typing"))
_SOURCE_CAP = 1 << 24


def _setup_child(fds, cpu_s):
    """Runs in the forked child before any untrusted code: fds, process group, limits."""
    for fd in _SUPERVISOR_FDS:
        os.close(fd)
    os.close(fds["status_r"])
    stdin = fds.get("stdin")
    if stdin is None:
        stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)  # never the parent's command pipe
    os.close(stdin)
    if "stdout_w" in fds:
        os.close(fds["stdout_r"])
        os.dup2(fds["stdout_w"], 1)
        os.close(fds["stdout_w"])
    os.setpgid(0, 0)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    for number in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGPIPE):
        _signal.signal(number, _signal.SIG_DFL)


def _child(code, test, fds, token, cpu_s):
    """Runs in the forked child: the program, then a stdio test or an in-process assert test
    (the fallback for tests the judge cannot carry). Never returns."""
    # Bind everything used after the program runs *before* it runs: the program may
    # monkeypatch builtins, os, sys or this module, but not these local references.
    run, write, exit_now = exec, os.write, os._exit
    settrace, setprofile = sys.settrace, sys.setprofile
    base_exception, memory_error, system_exit = BaseException, MemoryError, SystemExit
    stdout, write_fd, kind = sys.stdout, fds["status_w"], test["kind"]
    try:
        _setup_child(fds, cpu_s)
        if kind == "assert":
            check = compile(test["source"], "<test>", "exec")
    except base_exception:  # our own set-up failed, before any untrusted code ran
        write(write_fd, b"S")
        exit_now(71)
    namespace = _main_namespace()
    try:
        try:
            run(code, namespace)
        except system_exit as stop:
            if kind != "stdio" or stop.code not in (None, 0):
                raise
        if kind == "stdio":
            _finish_script(namespace)
        try:  # noqa: SIM105 - contextlib is not imported here (~3 ms a run)
            stdout.flush()
        except base_exception:
            pass
        write(write_fd, b"U")
        settrace(None)
        setprofile(None)
        if kind == "assert":
            run(check, namespace)
            write(write_fd, token)
    except memory_error:
        try:
            write(write_fd, b"M")
        finally:
            exit_now(1)
    except base_exception:
        exit_now(1)
    exit_now(0)


def _main_namespace():
    """The program's globals: a fresh ``__main__`` module's, put in ``sys.modules`` as plain
    Python does (``import __main__`` is the program, not the supervisor)."""
    module = type(sys)("__main__")
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    return module.__dict__


def _finish_script(namespace):
    """What the interpreter does when a script ends: wait for its non-daemon threads, run its
    ``atexit`` functions, flush ``sys.stdout`` / ``sys.stderr`` (whatever they are now) and
    let go of its objects (an unclosed writer flushes when it is collected)."""
    import atexit
    import gc

    module = sys.modules.get("threading")  # the program's view of it
    steps = [lambda: module is None or module._shutdown(), atexit._run_exitfuncs]
    steps += [lambda: sys.stdout.flush(), lambda: sys.stderr.flush(), namespace.clear,
              gc.collect] * 2
    for step in steps:
        try:  # noqa: SIM105 - contextlib is not imported here (~3 ms a run)
            step()
        except Exception:
            pass


def _wait_child(pid, pipes, timeout_s):
    """Collect the child's pipes (``{fd: cap}``) and its exit.

    Returns ``({fd: bytes}, truncated fds, status, cpu_seconds, timed_out)``; a pipe is kept up
    to its cap and drained beyond it.
    """
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None  # older kernel/Python: poll every 20 ms instead
    data = {fd: b"" for fd in pipes}
    open_fds, truncated, timed_out, done = set(pipes), set(), False, None
    while done is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            os.kill(pid, _signal.SIGKILL)
            done = os.wait4(pid, 0)
            break
        watch = sorted(open_fds) + ([pidfd] if pidfd is not None else [])
        wait = remaining if pidfd is not None else min(remaining, 0.02)
        for fd in select.select(watch, [], [], wait)[0]:
            if fd in open_fds:
                _read_into(fd, data, pipes[fd], open_fds, truncated)
        finished = os.wait4(pid, os.WNOHANG)
        if finished[0] == pid:
            done = finished
    for fd in pipes:  # whatever the child wrote before exiting is still in the pipe
        os.set_blocking(fd, False)
        try:
            while fd in open_fds:
                _read_into(fd, data, pipes[fd], open_fds, truncated)
        except OSError:
            open_fds.discard(fd)
        os.close(fd)
    if pidfd is not None:
        os.close(pidfd)
    rusage = done[2]
    return data, truncated, done[1], rusage.ru_utime + rusage.ru_stime, timed_out


def _read_into(fd, data, cap, open_fds, truncated):
    try:
        chunk = os.read(fd, 65536)
    except ConnectionResetError:  # a program process killed with our request still unread
        chunk = b""
    if not chunk:
        open_fds.discard(fd)
    elif len(data[fd]) + len(chunk) > cap:
        data[fd] = (data[fd] + chunk)[:cap]
        truncated.add(fd)
    else:
        data[fd] += chunk


def _classify(kind, data, status, cpu_used, cpu_s, timed_out, token):
    """Status of a test from what its child left behind (see the module docstring)."""
    signaled = os.WIFSIGNALED(status)
    over_cpu = signaled and (
        os.WTERMSIG(status) == _signal.SIGXCPU
        or (os.WTERMSIG(status) == _signal.SIGKILL and cpu_used >= cpu_s)
    )
    exited_ok = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if data == b"S":
        return "sandbox_error"
    if timed_out or over_cpu:
        return "timeout"
    if exited_ok and kind == "assert" and data == b"U" + token:
        return "passed"
    if exited_ok and kind == "stdio" and data in (b"U", b""):  # os._exit(0) ends a script too
        return "exited"
    if b"M" in data[:2]:
        return "memory"
    return "crashed" if signaled else "failed"


def _pipes_for(test, fds):
    if test["kind"] == "stdio":
        fds["stdin"] = _stdin_file(test["input"])
        fds["stdout_r"], fds["stdout_w"] = os.pipe()


def _stdin_file(text):
    """A file holding the test's stdin, at offset 0 (memfd; a temp file where unavailable)."""
    try:
        fd = os.memfd_create("stdin")
    except (AttributeError, OSError):
        import tempfile

        fd, path = tempfile.mkstemp()
        os.unlink(path)
    data = text.encode("utf-8")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _close_parent_ends(fds):
    for name in ("status_w", "stdin", "stdout_w"):
        if name in fds:
            os.close(fds[name])


def _run_test(code, test, run):
    """Fork a child for one test; return its response (see the module docstring)."""
    token = os.urandom(_TOKEN_BYTES)
    fds = {}
    try:
        fds["status_r"], fds["status_w"] = os.pipe()
        _pipes_for(test, fds)
        pid = os.fork()
    except OSError:  # e.g. EAGAIN: processes of an earlier run not yet reaped by the host
        for fd in fds.values():
            os.close(fd)
        return _response("sandbox_error", False)
    if pid == 0:
        try:
            _child(code, test, fds, token, run["cpu_s"])
        finally:
            os._exit(72)
    _close_parent_ends(fds)
    pipes = {fds["status_r"]: 2 + _TOKEN_BYTES}
    if "stdout_r" in fds:
        pipes[fds["stdout_r"]] = run["max_stdout_bytes"]
    data, truncated, status, cpu_used, timed_out = _wait_child(pid, pipes, run["timeout_s"])
    _sweep(run["kill_all"], pid)
    verdict_bytes = data[fds["status_r"]]
    verdict = _classify(test["kind"], verdict_bytes, status, cpu_used, run["cpu_s"], timed_out,
                        token)
    response = _response(verdict, verdict_bytes.startswith(b"U"))
    if test["kind"] == "stdio" and verdict == "exited":
        response["stdout"] = data[fds["stdout_r"]].decode("utf-8", "replace")
        response["truncated"] = fds["stdout_r"] in truncated
    return response


def _response(status, top, in_process=False):
    return {"status": status, "top": top, "value": None, "stdout": None, "truncated": False,
            "in_process": in_process}


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _lines(fd):
    """Lines read from ``fd`` with ``os.read`` (no buffered reader a child could inherit)."""
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return
            buffer += chunk
        line, buffer = buffer.split(b"\n", 1)
        yield line


def _setup_forked(close, cpu_s):
    """Set-up of a program or judge process before anything else runs in it."""
    for fd in _SUPERVISOR_FDS + close:
        os.close(fd)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    os.setpgid(0, 0)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    for number in (_signal.SIGINT, _signal.SIGTERM, _signal.SIGPIPE):
        _signal.signal(number, _signal.SIG_DFL)


def _program_process(code, link, close, run, describe, key, serve):
    """Forked child: the program, then ``serve`` (:func:`serve_program` of the private copy of
    the supervisor that :func:`main` made before any fork: its globals unreachable from the
    program) on ``link``. Never returns. Exit status: 0 served to the end, 1 an exception,
    3 ``MemoryError``, 71 set-up failed. Before the program runs: the audit hook that refuses
    frames, the collector's object graph and tracing while serving (:func:`guard_program`;
    docs/sandbox.md). The program and the serving run in a thread of their own
    (:func:`_apart`)."""
    exit_now, cap, serving = os._exit, 4 * run["max_value_bytes"] + 1024, [False]
    try:
        _setup_forked(close, run["cpu_s"])
        guard_program(serving)
        namespace = _main_namespace()
        steps = (starmap(exec, [(code, namespace)]), starmap(sys.stdout.flush, [()]),
                 starmap(sys.settrace, [(None,)]), starmap(sys.setprofile, [(None,)]),
                 starmap(serving.__setitem__, [(0, True)]),
                 starmap(serve, [(namespace, link, cap, describe, key)]),
                 starmap(exit_now, [(0,)]))
    except BaseException:
        exit_now(71)
    _apart(steps, exit_now)


def _apart(steps, exit_now):
    """Run ``steps`` (iterators of C calls) in a new thread started from C, so that no frame
    of the supervisor lies below the program's: a frame the program obtains (a trace hook's
    at its top level) leads back to nothing of ours, and as the program never runs on the
    main thread it cannot set a signal handler (Python runs those on the main thread only,
    with the frame they interrupt). This thread waits, without running Python, until that
    one ends: by ``exit_now(0)`` after serving, or by an exception (exit status 1, 3 for
    ``MemoryError``), seen when a lock only the thread's own locals hold is freed with them;
    it allocates nothing on its way out, so no finalizer of the program runs on it."""
    ended, raised, memory_error = SimpleQueue(), [], MemoryError
    marker, own = _thread.allocate_lock(), _thread._local()
    _watch = weakref_ref(marker, ended.put)  # called when the thread's locals are freed
    steps = chain(starmap(setattr, [(own, "marker", marker)]), *steps)
    del marker
    sys.unraisablehook = raised.append  # how the thread's exception reaches us (or not)
    size = resource.getrlimit(resource.RLIMIT_STACK)[0]
    _thread.stack_size(size if 0 < size <= 1 << 30 else 0)  # the main thread's stack
    _thread.start_new_thread(list().extend, (steps,))
    _thread.stack_size(0)
    ended.get()
    exit_now(3 if raised and raised[0][0] is memory_error else 1)


def _fork_program(code, run, describe, key, serve):
    """(pid, our end of its socket) of a fresh program process, or None when fork fails."""
    ours, theirs = _socket.socketpair()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return None
    if pid == 0:
        try:
            _program_process(code, theirs.fileno(), [ours.fileno()], run, describe, key, serve)
        finally:
            os._exit(72)
    theirs.close()
    return pid, ours


def _program_status(status, cpu_used, run, timed_out):
    """Status of a program process that ended before answering (exit codes above)."""
    signaled = os.WIFSIGNALED(status)
    if timed_out or (signaled and (os.WTERMSIG(status) == _signal.SIGXCPU or (
            os.WTERMSIG(status) == _signal.SIGKILL and cpu_used >= run["cpu_s"]))):
        return "timeout"
    if signaled:
        return "crashed"
    code = os.WEXITSTATUS(status)
    return {3: "memory", 71: "sandbox_error"}.get(code, "failed")


def _run_value(code, test, run, serve):
    """A value test: the program process answers one call; the value goes to the parent."""
    key = os.urandom(16)  # the answers' signing key (wire._signed), made for this test
    forked = _fork_program(code, run, describe=False, key=key, serve=serve)
    if forked is None:
        return _response("sandbox_error", False)
    pid, ours = forked
    cap = 4 * run["max_value_bytes"] + 1024
    request = {"id": 1, "op": "call", "name": test["name"], "args": test["args"],
               "kwargs": test["kwargs"], "prelude": test["prelude"]}
    try:
        ours.sendall(dumps_frame(request))  # small (the parent checks): fits the buffer
        ours.shutdown(_socket.SHUT_WR)
    except OSError:
        pass
    fd = ours.detach()
    data, truncated, status, cpu_used, timed_out = _wait_child(pid, {fd: 2 * cap + 64},
                                                               run["timeout_s"])
    _sweep(run["kill_all"], pid)
    return _value_response(data[fd], fd in truncated, status, cpu_used, run, timed_out, cap,
                           key)


def _value_response(data, truncated, status, cpu_used, run, timed_out, cap, key):
    exited = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    try:
        frames = split_frames(data, cap, key)
    except WireError:
        frames = None
    top = bool(frames) and frames[0] == {"names": {}, "back": []}
    if not exited or truncated:
        if truncated and exited:
            return _response("failed", top)  # a value over max_value_bytes
        return _response(_program_status(status, cpu_used, run, timed_out), top)
    if frames == []:
        return _response("failed", False)  # the program quit (exit status 0) at top level
    if top and len(frames) == 1:
        return _response("failed", True)  # the program quit inside the call
    if frames is None or len(frames) != 2 or not top or frames[1].get("id") != 1:
        return _response("sandbox_error", top)  # not exactly one hello and one answer
    answer = frames[1]
    if set(answer) == {"id", "raise", "back"}:
        return _response("failed", True)
    if set(answer) != {"id", "ok", "back"}:
        return _response("sandbox_error", True)
    response = _response("returned", True)
    response["value"] = "".join(_ENCODE(answer["ok"], 0))
    return response


def _judge_process(code, run, link, verdict_w, close, index, key):
    """Forked child (trusted): read test ``index`` from the tests pipe, judge it, report one
    verdict frame and exit 0. A test the proxies cannot carry runs in-process here, in a child
    of this process: its source never goes back to the supervisor, whose later forks are the
    next tests' program processes."""
    started = time.monotonic()
    try:
        tests_fd = _SUPERVISOR_FDS[1]
        _SUPERVISOR_FDS.remove(tests_fd)
        _setup_forked(close, run["cpu_s"])
        _SUPERVISOR_FDS[:] = [verdict_w, link]  # what a fallback's program process closes
        frame = read_frame(tests_fd, _SOURCE_CAP)
        os.close(tests_fd)
        if frame is None or frame.get("index") != index or type(frame.get("source")) is not str:
            raise WireError("tests pipe out of step")
        check = compile(frame["source"], "<test>", "exec")
    except BaseException:
        write_frame(verdict_w, {"verdict": "sandbox_error", "top": False})
        os._exit(0)
    verdict, top = judge_test(check, Link(link, 4 * run["max_value_bytes"] + 1024,
                                          program_names(code), key),
                              lambda: write_frame(verdict_w, {"top": True}))
    report = {"verdict": verdict, "top": top}
    if verdict == "unsupported":  # judged in-process after all (counted, docs/sandbox.md)
        os.close(link)  # the program process reads the end of its requests and exits
        _SUPERVISOR_FDS.remove(link)
        left = max(0.5, run["timeout_s"] - (time.monotonic() - started))
        response = _run_test(code, {"kind": "assert", "source": frame["source"]},
                             dict(run, timeout_s=left, kill_all=False))
        report = {"verdict": response["status"], "top": response["top"], "in_process": True}
    write_frame(verdict_w, report)
    os._exit(0)


def _judge_report(data, status):
    """The judge's one verdict frame, or None: exactly one, last, after at most one
    ``{"top": true}``, from a judge that exited with status 0."""
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        return None
    try:
        frames = split_frames(data, _SOURCE_CAP + 1024)
    except WireError:
        return None
    if not frames or frames[:-1] not in ([], [{"top": True}]):
        return None
    report = frames[-1]
    allowed = {"verdict", "top", "in_process"}
    if "verdict" not in report or not set(report) <= allowed or \
            type(report.get("top")) is not bool or report.get("in_process", True) is not True:
        return None
    return report


def _run_judged(code, test, run, serve):
    """An assert test: program process + judge process; the judge's verdict decides."""
    key = os.urandom(16)  # the answers' signing key (wire._signed), made for this test
    forked = _fork_program(code, run, describe=True, key=key, serve=serve)
    if forked is None:
        return _response("sandbox_error", False)
    pid, ours = forked
    verdict_r, verdict_w = os.pipe()
    try:
        judge = os.fork()
    except OSError:
        judge = None
    if judge == 0:
        try:
            _judge_process(code, run, ours.fileno(), verdict_w, [verdict_r], test["index"],
                           key)
        finally:
            os._exit(72)
    ours.close()
    os.close(verdict_w)
    if judge is None:
        os.close(verdict_r)
        _sweep(run["kill_all"], pid)
        return _response("sandbox_error", False)
    started = time.monotonic()
    data, _, status, _, timed_out = _wait_child(judge, {verdict_r: _SOURCE_CAP + 4096},
                                                run["timeout_s"] + 1)
    report = None if timed_out else _judge_report(data[verdict_r], status)
    verdict = None if report is None else report["verdict"]
    if timed_out:
        try:  # did the program's top level finish?
            timed_out = {"top": True} in split_frames(data[verdict_r], _SOURCE_CAP + 1024)
        except WireError:
            timed_out = True
        response = _response("timeout", timed_out)
    elif verdict == "gone":  # the program ended or broke the protocol: its exit says why
        left = max(0.0, run["timeout_s"] - (time.monotonic() - started))
        _, _, p_status, p_cpu, p_timed_out = _wait_child(pid, {}, left)
        response = _response(_program_status(p_status, p_cpu, run, p_timed_out),
                             report["top"])
    elif verdict in ("passed", "failed", "memory", "sandbox_error", "timeout", "crashed"):
        response = _response(verdict, report["top"], report.get("in_process", False))
    else:  # no single verdict from a judge that exited cleanly: a loss, never a pass
        response = _response("crashed", False)
    _sweep(run["kill_all"], pid)
    return response


def _answer(code, test, run, serve):
    if code is None:
        return _response("failed", False)
    if test["kind"] == "value":
        return _run_value(code, test, run, serve)
    if test["kind"] == "assert":
        return _run_judged(code, test, run, serve)
    return _run_test(code, test, run)


def main():
    result_fd, tests_fd = int(sys.argv[-2]), int(sys.argv[-1])
    _prctl(4, 0)  # PR_SET_DUMPABLE 0, before anything else (see the module docstring)
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    _prctl(1, _signal.SIGKILL)  # PR_SET_PDEATHSIG: die if the parent dies
    _SUPERVISOR_FDS.extend([result_fd, tests_fd])
    _clear_keyrings()  # what an earlier run of this uid left there never reaches this one
    _deny_sysinfo()  # host-wide memory figures: a channel between concurrent runs
    _write_all(result_fd, b"R\n")
    commands = _lines(0)
    run = _COMMAND(next(commands).decode(), 0)[0]
    _apply_limits(run["limits"])
    try:
        code = compile(run["code"], "<program>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # too deep to compile: 0
        code = None
    for name in sorted(program_names(code) & _PRELOAD if code is not None else ()):
        try:  # noqa: SIM105 - one that fails is the program's own import, as before
            __import__(name)
        except Exception:
            pass
    # the private copy that serves in every program process, made once here (only this frame
    # holds it: nothing a program can reach refers to it; each fork gets its own pages)
    serve = private_world(globals())["serve_program"]
    for index, line in enumerate(commands):
        response = _answer(code, _COMMAND(line.decode(), 0)[0], run, serve)
        response["id"] = index
        _write_all(result_fd, ("".join(_ENCODE(response, 0)) + "\n").encode())
    _sweep(run["kill_all"], 0)  # nothing may outlive the run
    _clear_keyrings()
    os._exit(0)  # every answer is written (os.write): the interpreter's teardown is not needed


if __name__ == "__main__":
    main()
