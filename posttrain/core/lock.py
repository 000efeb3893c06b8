"""One run per `out_dir`: an exclusive lock on `out_dir/.posttrain.lock` (no torch).

The lock is an `flock` on the open file, so the kernel releases it when the process ends, however
it ends (exit, exception, SIGKILL): a lock file left behind by a dead run is stale and simply
taken over. The file holds the holder's pid, host and start time, for the refusal message of a
second run. A second lock on the same folder from this same process (a notebook cell run
again) takes the lock over from the first.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".posttrain.lock"
_held: dict[str, OutDirLock] = {}  # this process's locks, by resolved path


class OutDirBusy(RuntimeError):
    """Another live process holds the lock of this `out_dir`."""


class OutDirLock:
    """The lock of one `out_dir`; `release()` (idempotent) or the process's end frees it."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self._fd: int | None = None

    @classmethod
    def acquire(cls, out_dir: str | Path) -> OutDirLock:
        """Take the lock (creating `out_dir`), or raise OutDirBusy naming the holder."""
        lock = cls(out_dir)
        key = str(lock.path.resolve())
        if key in _held:  # this process holds it already: the newer owner takes it over
            lock._fd, _held[key]._fd = _held[key]._fd, None
            _held[key] = lock
            return lock
        lock.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutDirBusy(f"another run is writing to {str(Path(out_dir))!r} ({holder}); "
                             "wait for it to end or choose another out_dir") from None
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {stamp} UTC"
                  .encode(), 0)
        lock._fd = fd
        _held[key] = lock
        return lock

    def release(self) -> None:
        """Free the lock (the file stays; an unlocked file is no lock)."""
        if self._fd is None:
            return
        key = str(self.path.resolve())
        if _held.get(key) is self:
            del _held[key]
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
