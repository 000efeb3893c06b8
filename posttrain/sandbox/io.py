"""The parent's side of the conversation with the sandbox supervisor (:mod:`.harness`).

:func:`exchange` sends the run and every test at once, then judges the answers here as they
arrive (one per test, in order); when the caller stops early it stops reading and the run is
killed, so early stopping needs no verdict from inside the sandbox.
Everything the supervisor writes is checked strictly: a report line that is too long, not one
JSON object of the exact shape, more answers than tests asked, or any byte after the last
answer makes the whole run a ``sandbox_error`` (:class:`ProtocolError`); nothing is parsed
leniently or truncated into shape.
"""

from __future__ import annotations

import math
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from posttrain.sandbox.wire import WireError, loads_strict

RESPONSE_KEYS = {"id": int, "status": str, "top": bool, "value": (str, type(None)),
                 "stdout": (str, type(None)), "truncated": bool, "in_process": bool}
_HELLO = b"R"


class ProtocolError(ValueError):
    """The sandbox's report broke the protocol (forged, malformed, oversized, extra)."""


@dataclass
class Exchange:
    """What came back: answers judged, captured output, and how the run ended."""

    answered: int = 0
    stdout: bytes = b""
    stderr: bytes = b""
    started: bool = False
    timed_out: bool = False
    stopped_early: bool = False
    error: str = ""


def parse_response(line: bytes) -> dict:
    """One answer line -> dict with exactly ``RESPONSE_KEYS`` of the right types."""
    try:
        response = loads_strict(line)  # no floats, NaN, duplicate keys
    except WireError as exc:
        raise ProtocolError(f"report line is not a strict JSON object: {exc}") from exc
    if type(response) is not dict or set(response) != set(RESPONSE_KEYS):
        raise ProtocolError(f"report line has the wrong shape: {line[:200]!r}")
    for key, kind in RESPONSE_KEYS.items():
        if not isinstance(response[key], kind) or (kind in (bool, int) and
                                                   type(response[key]) is not kind):
            raise ProtocolError(f"report field {key!r} has the wrong type: {line[:200]!r}")
    return response


class _Streams:
    """Non-blocking pipes of one supervisor: stdin (commands), stdout/stderr (capped, kept for
    debugging, never judged) and the result pipe (answers, strict)."""

    def __init__(self, proc: subprocess.Popen, result_fd: int, out_cap: int,
                 line_cap: int, sources: tuple[int, bytes] | None = None) -> None:
        assert proc.stdin and proc.stdout and proc.stderr
        self.proc, self.result_fd = proc, result_fd
        self.out_cap, self.line_cap = out_cap, line_cap
        self.stdin_fd: int | None = proc.stdin.fileno()
        self.outgoing, self.close_after = b"", False
        self.buffers = {proc.stdout.fileno(): b"", proc.stderr.fileno(): b"", result_fd: b""}
        self.sel = selectors.DefaultSelector()
        os.set_blocking(self.stdin_fd, False)
        for fd in self.buffers:
            self.sel.register(fd, selectors.EVENT_READ)
        self.result_open = True
        self.sources_fd, self.sources = sources or (None, b"")
        if self.sources_fd is not None and self.sources:
            os.set_blocking(self.sources_fd, False)
            self.sel.register(self.sources_fd, selectors.EVENT_WRITE)

    def send(self, data: bytes, close_after: bool = False) -> None:
        """Queue ``data`` for the supervisor's stdin; ``close_after``: then close it (EOF)."""
        if self.stdin_fd is None:
            return
        if not self.outgoing:
            self.sel.register(self.stdin_fd, selectors.EVENT_WRITE)
        self.outgoing += data
        self.close_after = close_after

    def close_stdin(self) -> None:
        if self.stdin_fd is not None:
            if self.outgoing:
                self.sel.unregister(self.stdin_fd)
            self.outgoing, self.stdin_fd = b"", None
            assert self.proc.stdin
            self.proc.stdin.close()

    def pump(self, timeout: float) -> None:
        """One round of I/O; raises ProtocolError when the result pipe overflows a line."""
        for key, _ in self.sel.select(max(0.0, timeout)):
            fd = key.fd
            if fd == self.stdin_fd:
                self._write()
                continue
            if fd == self.sources_fd:
                self._write_sources()
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self.sel.unregister(fd)
                if fd == self.result_fd:
                    self.result_open = False
                continue
            if fd == self.result_fd:
                self.buffers[fd] += chunk
                tail = self.buffers[fd].rsplit(b"\n", 1)[-1]
                if len(tail) > self.line_cap:
                    raise ProtocolError(f"report line longer than {self.line_cap} bytes")
            elif len(self.buffers[fd]) < self.out_cap:
                self.buffers[fd] += chunk[: self.out_cap - len(self.buffers[fd])]

    def _write(self) -> None:
        assert self.stdin_fd is not None
        try:
            sent = os.write(self.stdin_fd, self.outgoing[:65536])
        except BlockingIOError:
            return
        except BrokenPipeError:  # the supervisor died; its missing answers will tell
            self.close_stdin()
            return
        self.outgoing = self.outgoing[sent:]
        if not self.outgoing:
            self.sel.unregister(self.stdin_fd)
            if self.close_after:
                self.close_stdin()

    def _write_sources(self) -> None:
        """Assert tests' sources, for the judge processes (the caller closes the pipe)."""
        try:
            sent = os.write(self.sources_fd, self.sources[:65536])  # type: ignore[arg-type]
        except BlockingIOError:
            return
        except BrokenPipeError:
            sent = len(self.sources)
        self.sources = self.sources[sent:]
        if not self.sources:
            self.sel.unregister(self.sources_fd)  # type: ignore[arg-type]

    def next_line(self) -> bytes | None:
        buffer = self.buffers[self.result_fd]
        if b"\n" not in buffer:
            return None
        line, self.buffers[self.result_fd] = buffer.split(b"\n", 1)
        return line

    def pending_result_bytes(self) -> bytes:
        return self.buffers[self.result_fd]

    def close(self) -> None:
        self.sel.close()


def exchange(proc: subprocess.Popen, result_fd: int, run: bytes, tests: Sequence[bytes],
             on_answer: Callable[[int, dict], bool], deadline: float, out_cap: int,
             line_cap: int, grace_s: float = 0.5,
             sources: tuple[int, bytes] | None = None,
             per_answer_s: float = math.inf) -> Exchange:
    """Drive one run; ``on_answer(i, response)`` judges test ``i`` and says whether to go on.

    ``on_answer`` may raise :class:`ProtocolError`; so may the checks here. Either ends the run
    with ``Exchange.error`` set (the caller turns it into ``sandbox_error``). Each answer is due
    within ``per_answer_s`` of the start line or of the last answer (a supervisor the program
    stopped holds the slot that long, not until the run's ``deadline``): late, the run ends
    timed out.
    """
    io = _Streams(proc, result_fd, out_cap, line_cap, sources)
    outcome = Exchange()
    io.send(run + b"\n" + b"".join(test + b"\n" for test in tests), close_after=True)
    done, grace_end, due = False, None, math.inf
    try:
        while not outcome.stopped_early:
            while not outcome.stopped_early and (line := io.next_line()) is not None:
                if not outcome.started:
                    if line != _HELLO:
                        raise ProtocolError(f"bad start of report: {line[:200]!r}")
                    outcome.started, due = True, time.monotonic() + per_answer_s
                    continue
                if done:
                    raise ProtocolError("report after the last answer")
                index = outcome.answered
                response = parse_response(line)
                if response["id"] != index:
                    raise ProtocolError(f"answer {response['id']} where {index} was due")
                go_on = on_answer(index, response)
                outcome.answered += 1
                due = time.monotonic() + per_answer_s
                if outcome.answered == len(tests):
                    done, grace_end = True, time.monotonic() + grace_s
                elif not go_on:  # the caller kills the run: later answers are not read
                    outcome.stopped_early = True
            if outcome.stopped_early:
                break
            if not io.result_open:
                if io.pending_result_bytes():
                    raise ProtocolError("report ends without a newline")
                break
            now = time.monotonic()
            end = min(deadline, due) if grace_end is None else min(deadline, grace_end)
            if now >= end:
                if io.pending_result_bytes():
                    raise ProtocolError("unterminated report line (or bytes after the last "
                                        "answer)")
                outcome.timed_out = not done
                break
            io.pump(end - now)
    except ProtocolError as exc:
        outcome.error = str(exc)
    finally:
        out, err = proc.stdout, proc.stderr
        assert out and err
        outcome.stdout, outcome.stderr = io.buffers[out.fileno()], io.buffers[err.fileno()]
        io.close()
    return outcome
