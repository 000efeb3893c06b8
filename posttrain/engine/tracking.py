"""Where a run's metrics go: `metrics.jsonl` always, plus the trackers named in `report_to`.

- `metrics.jsonl`: one JSON object per logged step (`"step"`, `"time"`, metric names); the file
  that scripts and acceptance checks read.
- `tensorboard`: event files under `out_dir/tb`; `trackio`: local-first (SQLite under
  `~/.cache/huggingface/trackio`, no account), TRL users' wandb-like API; `wandb`: Weights &
  Biases (offline with `WANDB_MODE=offline`). A tracker not installed is a clear error before
  any model loads (`load_session`).

Console: on a terminal a rich progress bar; otherwise (pipe, nohup, Slurm, Jupyter)
`MetricsLogger` prints one line of `CONSOLE_KEYS` to stderr at every logged step, as TRL does;
`progress: false` silences both.
More: docs/trainers.md, "Module notes", posttrain.engine.tracking.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.config import ConfigError


class _Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, out_dir: Path, run_name: str, config: dict[str, Any],
                 purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run hides the events a crashed one wrote after its checkpoint
        self.writer = SummaryWriter(str(out_dir / "tb"), purge_step=purge_step)

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


def _make(kind: str, out_dir: Path, run_name: str, config: dict[str, Any],
          purge_step: int | None = None) -> _Tracker:
    if kind == "tensorboard":
        return _TensorBoard(out_dir, run_name, config, purge_step)
    return _WandbLike(kind, out_dir, run_name, config)


# the metrics of a console line, in this order (each only when the step has it)
CONSOLE_KEYS = ("loss/total", "loss/policy", "loss/sft", "loss/dpo", "loss/rm", "loss/prm",
                "reward/mean", "reward/accuracy", "rewards/accuracy", "train/accuracy",
                "train/step_accuracy", "kl/mean", "kl/token_mean", "kl/coef", "train/grad_norm",
                "train/lr", "response/truncated_frac", "async/staleness_mean",
                "async/queue_groups", "eval/accuracy", "perf/step_seconds")


def console_line(step: int, metrics: dict[str, float], max_steps: int | None = None,
                 name: str = "") -> str:
    """``[run] step 5/100 loss/policy=0.0123 reward/mean=0.5 ...`` for a non-terminal stderr."""
    head = f"step {step}/{max_steps}" if max_steps else f"step {step}"
    parts = [f"[{name}] {head}" if name else head]
    parts += [f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS
              if k in metrics and math.isfinite(metrics[k])]
    return " ".join(parts)


class MetricsLogger:
    """Metrics to `metrics.jsonl` (one object per step) and the trackers in `report_to`, and
    a console line per logged step when stderr is not a terminal (`console`: None = that
    rule, honouring the config's `progress`; True / False forces it)."""

    def __init__(self, out_dir: str | Path, report_to: list[str] | tuple[str, ...] = (
            "tensorboard",), run_name: str = "", config: dict[str, Any] | None = None,
                 purge_step: int | None = None, console: bool | None = None) -> None:
        config = config or {}
        self.console = (bool(config.get("progress", True)) and not sys.stderr.isatty()
                        if console is None else console)
        self.max_steps = config.get("max_steps")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._fh = self.path.open("a")
        name = run_name or self.out_dir.name
        self.name = name
        self._trackers = [_make(k, self.out_dir, name, config, purge_step)
                          for k in report_to]

    def tell(self) -> int:
        """Bytes written to metrics.jsonl so far (a checkpoint records it for resume)."""
        self._fh.flush()
        return self._fh.tell()

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        flat = {k: to_float(v) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, "time": time.time(), **flat}) + "\n")
        self._fh.flush()
        for tracker in self._trackers:
            tracker.log(step, flat)
        if self.console:
            print(console_line(step, flat, self.max_steps, self.name), file=sys.stderr,
                  flush=True)
        return flat

    def close(self) -> None:
        self._fh.close()
        for tracker in self._trackers:
            tracker.close()


def to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else float("nan")
    return float(v)


class NullLogger:
    """The logger of ranks other than 0: metrics are computed, nothing is written."""

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        return {k: to_float(v) for k, v in metrics.items()}

    def tell(self) -> int:
        return 0

    def close(self) -> None:
        pass
