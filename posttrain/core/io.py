"""Atomic files and the run's ``summary.json`` (no torch)."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader sees the old
    file or the whole new one, never a partial write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def write_summary(out_dir: str | Path, cfg: Any | None, **fields: Any) -> Path:
    """Write `summary.json` (eval_before, eval_after, seconds, peak_rss_mb, ...) atomically.

    ``cfg`` (a config dataclass) is stored under ``config``.
    """
    data = {"peak_rss_mb": round(peak_rss_mb(), 1), **fields}
    if cfg is not None:
        data["config"] = dataclasses.asdict(cfg)
    return atomic_write_text(Path(out_dir) / "summary.json",
                             json.dumps(data, indent=2, default=str) + "\n")


class RunStopped(RuntimeError):
    """A run stopped by SIGTERM / SIGINT before `max_steps`: it wrote a checkpoint, no `final/`."""


def finished(summary: dict[str, Any], what: str = "the run") -> dict[str, Any]:
    """`summary` (what `train()` returned) when the run reached `max_steps`; RunStopped when a
    signal stopped it (`stopped_at_step`), so a caller does not go on to load a `final/` that
    was never written."""
    if "stopped_at_step" in summary:
        raise RunStopped(f"{what} was stopped by a signal at step {summary['stopped_at_step']} "
                         "and wrote no final/ (resume it with resume_from: latest)")
    return summary
