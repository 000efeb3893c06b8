"""Where a run's metrics go: `metrics.jsonl` always, plus the trackers named in `report_to`.

- `metrics.jsonl`: one JSON object per logged step (`"step"`, `"time"`, metric names); the file
  that scripts and acceptance checks read.
- `tensorboard`: event files under `out_dir/tb`.
- `trackio`: local-first (a SQLite file under `~/.cache/huggingface/trackio`, no account or
  network needed), the wandb-like API that TRL users know; `pip install trackio`.
- `wandb`: Weights & Biases; `pip install wandb` (offline with `WANDB_MODE=offline`).

A tracker that cannot be imported is a clear error when the logger starts, before any training.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.config import ConfigError


class _Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, out_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if math.isfinite(v):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class _WandbLike:
    """trackio and wandb share the API: init(project, name, config), log(dict, step), finish()."""

    def __init__(self, module: str, out_dir: Path, run_name: str, config: dict[str, Any]) -> None:
        try:
            lib = __import__(module)
        except ImportError as err:
            raise ConfigError(f"config key 'report_to': {module} is not installed "
                              f"(pip install {module})") from err
        self.lib = lib
        self.run = lib.init(project="posttrain", name=run_name, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.lib.log(metrics, step=step)

    def close(self) -> None:
        self.lib.finish()


def _make(kind: str, out_dir: Path, run_name: str, config: dict[str, Any]) -> _Tracker:
    if kind == "tensorboard":
        return _TensorBoard(out_dir, run_name, config)
    return _WandbLike(kind, out_dir, run_name, config)


class MetricsLogger:
    """Metrics to `metrics.jsonl` (one object per step) and the trackers in `report_to`."""

    def __init__(self, out_dir: str | Path, report_to: list[str] | tuple[str, ...] = (
            "tensorboard",), run_name: str = "", config: dict[str, Any] | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._fh = self.path.open("a")
        name = run_name or self.out_dir.name
        self._trackers = [_make(k, self.out_dir, name, config or {}) for k in report_to]

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        flat = {k: to_float(v) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, "time": time.time(), **flat}) + "\n")
        self._fh.flush()
        for tracker in self._trackers:
            tracker.log(step, flat)
        return flat

    def close(self) -> None:
        self._fh.close()
        for tracker in self._trackers:
            tracker.close()


def to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else float("nan")
    return float(v)
