"""Pieces every trainer shares: seeding, optimizer and schedule, metrics, checkpoints, summary."""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config import BaseConfig, to_dict


def set_seed(seed: int) -> torch.Generator:
    """Seed python, torch (and numpy if present); return a torch.Generator for sampling."""
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


def setup_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)


def build_optimizer(
    model: torch.nn.Module, cfg: BaseConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over trainable parameters plus warm-up then constant/linear/cosine decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.adam_betas),  # type: ignore[arg-type]
                            weight_decay=cfg.weight_decay)
    warm, total = cfg.warmup_steps, max(1, total_steps)

    def factor(step: int) -> float:
        if warm > 0 and step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        if cfg.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def clip_and_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                  sched: torch.optim.lr_scheduler.LambdaLR, max_grad_norm: float) -> torch.Tensor:
    """Clip gradients (when max_grad_norm > 0), step, zero; return the pre-clip grad norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        norm = torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return norm.detach()


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def merged(model: Any) -> Any:
    """The plain model to save: LoRA adapters merged into the weights (peft), else `model`."""
    merge = getattr(model, "merge_and_unload", None)
    return merge() if callable(merge) and hasattr(model, "peft_config") else model


def save_checkpoint(model: Any, tokenizer: Any, path: str | Path) -> Path:
    """Write a `from_pretrained`-loadable safetensors checkpoint atomically.

    The files go to a temporary sibling directory that is renamed into place only when complete,
    so a crash never leaves a half-written checkpoint under `path`.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)
    return path


class MetricsLogger:
    """Metrics to `metrics.jsonl` (one object per step) and TensorBoard event files."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._fh = self.path.open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except ImportError:  # pragma: no cover - tensorboard is a dependency
                self._tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        flat = {k: _to_float(v) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, "time": time.time(), **flat}) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in flat.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        return flat

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def _to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else float("nan")
    return float(v)


def write_summary(out_dir: str | Path, cfg: BaseConfig | None, **fields: Any) -> Path:
    """Write `summary.json` (eval_before, eval_after, seconds, peak_rss_mb, ...) atomically."""
    path = Path(out_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"peak_rss_mb": round(peak_rss_mb(), 1), **fields}
    if cfg is not None:
        data["config"] = to_dict(cfg)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def save_config(out_dir: str | Path, cfg: BaseConfig) -> None:
    import yaml

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
