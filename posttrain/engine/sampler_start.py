"""The start of `async_rollouts`' sampler process, importable without torch: the CLI starts the
process before the learner's own imports (`start_early`), so the two processes import torch and
transformers at the same time and the learner's first step does not wait for the sampler's
imports (docs/async.md). The process learns what it samples with (config, tokenizer, policy)
later, through its `setup` queue (`SamplerProcess.attach` in `engine/async_rollout.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import signal
from dataclasses import dataclass
from typing import Any

SAMPLER_NAME = "posttrain-sampler"


@dataclass
class SamplerParts:
    """A started sampler process and what the learner talks to it with: the `setup` queue
    (what to sample with, once), `jobs`, `results`, the pushed `version`, the last step whose
    job `loaded` its weights, and the `lock` around the shared weights."""

    proc: Any
    setup: Any
    jobs: Any
    results: Any
    version: Any
    loaded: Any
    lock: Any


def start_sampler() -> SamplerParts:
    """Spawn the sampler process; it imports torch, transformers and the samplers at once and
    then waits for its setup (`sampler_main` of `engine/sampler_loop.py`)."""
    ctx = multiprocessing.get_context("spawn")
    parts = SamplerParts(None, ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Value("q", -1),
                         ctx.Value("q", 0), ctx.Lock())
    parts.proc = ctx.Process(target=_entry, name=SAMPLER_NAME, args=(
        os.getpid(), parts.setup, parts.jobs, parts.results, parts.version, parts.loaded,
        parts.lock))
    parts.proc.start()
    return parts


def _entry(*args: Any) -> None:
    """The process's first call: its loop (torch, transformers) is imported here, in the
    process; the learner imports this module before torch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the learner stops us (after a save)
    from posttrain.engine.sampler_loop import sampler_main

    sampler_main(*args)


_EARLY: list[SamplerParts] = []
"""The process `start_early` started, until a trainer takes it (`take_early`)."""


def start_early(command: str, argv: list[str]) -> None:
    """`posttrain grpo [--config R] [key=value ...]` with `async_rollouts: true` on one
    process: start the sampler process now, before the trainer's imports. Only for a config
    that validates (built silently: the run builds it again and reports any error); the
    trainer's own refusals then stop it (`close_early`)."""
    if command != "grpo" or os.environ.get("WORLD_SIZE", "1") != "1":
        return
    from posttrain.config import GRPOConfig, build_config, hints

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default=None)
    noted = set(hints._noted)  # the run's own build says its notes (once per process)
    try:
        args, overrides = parser.parse_known_args(argv)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cfg = build_config(GRPOConfig, args.config, overrides)
    except (Exception, SystemExit):  # noqa: BLE001 - the run builds it again and says why
        return
    finally:
        hints._noted.intersection_update(noted)
    if cfg.async_rollouts and cfg.device in ("auto", "cpu"):
        _EARLY.append(start_sampler())


def take_early() -> SamplerParts | None:
    """The process `start_early` started (once), or None."""
    return _EARLY.pop() if _EARLY else None


def close_early() -> None:
    """Stop a process `start_early` started that no trainer took (the run failed before)."""
    while _EARLY:  # it holds nothing yet: ended at once, not after its imports
        parts = _EARLY.pop()
        parts.proc.kill()
        parts.proc.join(5)
        parts.jobs.cancel_join_thread()
        parts.setup.cancel_join_thread()


def stop(proc: Any, jobs: Any, setup: Any = None) -> None:
    """Ask the sampler to stop (waiting for its setup, or for a job), then end it."""
    if proc.is_alive():
        with contextlib.suppress(OSError, ValueError):  # a queue already closed
            jobs.put(None)
            if setup is not None:
                setup.put(None)
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    jobs.cancel_join_thread()
    if setup is not None:
        setup.cancel_join_thread()
