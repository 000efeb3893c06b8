"""A run's output directory: its lock, what an earlier run left there (refused, replaced or
resumed), the config keys changed since a checkpointed run, and the lines a resumed or a
signalled run prints."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from posttrain.config import BaseConfig, ConfigError, to_dict
from posttrain.core.lock import OutDirBusy, OutDirLock
from posttrain.engine.checkpoint import list_checkpoints

# what an earlier run leaves in out_dir: its presence refuses a fresh run; `overwrite` clears it
RUN_MARKERS = ("metrics.jsonl", "checkpoints")
RUN_FILES = (*RUN_MARKERS, "summary.json", "reward_errors.jsonl", "completions.jsonl", "tb")
IGNORED_CHANGES = ("resume_from", "overwrite")


def prepare_out_dir(cfg: BaseConfig, is_main: bool, name: str = "train") -> OutDirLock | None:
    """Lock `out_dir` for this run (rank 0; a second run there is refused), then refuse a fresh
    run into an `out_dir` holding an earlier one (it would append to its metrics.jsonl, and a
    later `resume_from: latest` would resume the older run), unless `resume_from` is set; with
    `overwrite: true`, or `resume_from: latest` and no checkpoint to resume (said on stderr),
    rank 0 deletes the earlier run's files. Returns the lock (None on other ranks)."""
    lock = None
    if is_main:
        try:
            lock = OutDirLock.acquire(cfg.out_dir)
        except OutDirBusy as err:
            raise ConfigError(f"config key 'out_dir'={cfg.out_dir!r}: {err}") from None
    out = Path(cfg.out_dir)
    found = [name for name in RUN_MARKERS if _holds_data(out / name)]
    nothing = cfg.resume_from == "latest" and not list_checkpoints(out)
    if nothing and is_main:
        print(f"[{name}] resume_from: latest: nothing to resume (no checkpoint in "
              f"{out / 'checkpoints'}), starting fresh"
              + (f"; the earlier run's {', '.join(found)} replaced" if found else ""),
              file=sys.stderr)
    if not found or (cfg.resume_from and not nothing):
        return lock
    if not (cfg.overwrite or nothing):
        if lock is not None:
            lock.release()
        raise ConfigError(f"config key 'out_dir'={cfg.out_dir!r}: holds an earlier run "
                          f"({', '.join(found)}); set resume_from: latest to continue it, "
                          "overwrite: true to replace it, or choose another out_dir")
    if is_main:
        for name_ in RUN_FILES:
            path = out / name_
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    return lock


def _holds_data(path: Path) -> bool:
    """A non-empty file, or a directory with an entry (a trainer made but never trained leaves
    an empty metrics.jsonl: not a run)."""
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def config_changes(out_dir: str | Path, cfg: BaseConfig) -> list[str]:
    """`key: old -> new` for each config key whose value differs from the earlier run's
    `out_dir/config.yaml` (none when it is missing or unreadable)."""
    import yaml

    path = Path(out_dir) / "config.yaml"
    try:
        old = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    new = to_dict(cfg)
    return [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items()
            if k not in IGNORED_CHANGES and k in old and old[k] != v]


def report_resume(name: str, step: int, changes: list[str]) -> None:
    """'resumed from step N' on stderr, with the config keys changed since that run."""
    print(f"[{name}] resumed from step {step}", file=sys.stderr)
    if changes:
        print(f"[{name}] config keys changed since the checkpointed run: {'; '.join(changes)}",
              file=sys.stderr)


def report_stop(name: str, step: int, max_steps: int, out_dir: str) -> None:
    """The one line a run stopped by SIGTERM / SIGINT prints: no `final/` was written."""
    print(f"[{name}] warning: stopped by a signal at step {step} of {max_steps}: a checkpoint "
          f"is in {out_dir}/checkpoints but there is NO {out_dir}/final; the summary has "
          "stopped_at_step; resume_from: latest continues the run", file=sys.stderr)
