"""Process set-up: seeds and CPU threads.

Threads: torch's worker threads wait on each other, so one core taken by another process slows
every step (2 threads beside 2 busy processes on 2 cores: SFT steps 4x, sampling 7.5x slower
than one thread; benchmarks/busy_threads.py). `threads: 0` takes the cores no other process
keeps busy when the run starts.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch


def set_seed(seed: int) -> torch.Generator:
    """Seed python, torch (and numpy if present); return a CPU torch.Generator.

    The generator drives data order and, through a seed drawn from it, sampling on any device
    (the rollout derives a generator on the model's device).
    """
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


_DEFAULT_THREADS = torch.get_num_threads()  # torch's own choice, before any set_num_threads


def busy_cores(window_s: float = 0.2) -> float:
    """Cores that other processes keep busy now: the machine's busy time in /proc/stat over a
    short sleep of this process; where there is no /proc/stat, the 1-minute load average."""
    def busy_total() -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [float(x) for x in f.readline().split()[1:9]]  # user .. steal
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # minus idle and iowait

    try:
        busy0, total0 = busy_total()
        time.sleep(window_s)
        busy1, total1 = busy_total()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(total1 - total0, 1.0)


def setup_threads(threads: int) -> None:
    """torch's CPU threads: `threads`, or for 0 torch's default (OMP_NUM_THREADS, else one per
    core) less the cores other processes keep busy at start (at least 1), said in one line."""
    if threads == 0 and "OMP_NUM_THREADS" in os.environ:
        return  # the user's (or torchrun's) choice
    cores = os.cpu_count() or 1
    busy = busy_cores()
    free = max(1, int(cores - busy + 0.5))
    if threads == 0 and free < _DEFAULT_THREADS:
        torch.set_num_threads(free)
        print(f"posttrain: note: the machine is busy ({busy:.1f} of {cores} cores used by other "
              f"processes): {free} torch thread(s) instead of {_DEFAULT_THREADS} (threads: N "
              "sets them)", file=sys.stderr)
        return
    torch.set_num_threads(threads or _DEFAULT_THREADS)
    if threads > free and busy >= 0.5:
        print(f"posttrain: warning: threads: {threads} on a busy machine ({busy:.1f} of {cores} "
              f"cores used by other processes): torch's threads wait on each other, steps can "
              f"run several times slower; threads: 0 takes the free cores", file=sys.stderr)


def sequence_seed(*keys: int | str) -> int:
    """A 63-bit seed from keys such as (seed, step, prompt index, sample index): draws made with
    it depend on those keys only, not on batch composition, rank count or resume point."""
    import hashlib

    digest = hashlib.blake2b(":".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
