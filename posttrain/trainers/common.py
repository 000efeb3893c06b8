"""Pieces every trainer shares: seeding, optimizer and schedule, checkpoints, summary."""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from posttrain.config import BaseConfig, to_dict
from posttrain.core.io import peak_rss_mb, write_summary  # noqa: F401 (moved to core)
from posttrain.core.runtime import set_seed, setup_threads  # noqa: F401 (moved to core)


def sequence_seed(*keys: int | str) -> int:
    """A 63-bit seed from keys such as (seed, step, prompt index, sample index): draws made with
    it depend on those keys only, not on batch composition, rank count or resume point."""
    import hashlib

    digest = hashlib.blake2b(":".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup`` steps, then constant, linear or cosine decay to ``min_ratio``.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decays = {
        "constant": lambda p: 1.0,
        "linear": lambda p: 1.0 - p,
        "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    }
    if schedule not in decays:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {sorted(decays)}")
    if schedule == "constant":
        return 1.0
    return min_ratio + (1.0 - min_ratio) * decays[schedule](progress)


def build_optimizer(
    params: list[torch.nn.Parameter] | torch.nn.Module, cfg: BaseConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` (a module: its trainable parameters) plus warm-up then
    constant/linear/cosine decay.

    The one place every trainer gets its optimizers and schedules from (`lr`, `adam_betas`,
    `weight_decay`, `warmup_steps`, `lr_schedule`, `min_lr_ratio`).
    """
    if isinstance(params, torch.nn.Module):
        params = [p for p in params.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.adam_betas),  # type: ignore[arg-type]
                            weight_decay=cfg.weight_decay, fused=_fused_adam_ok(params) or None)
    total = max(1, total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(
        step, total, cfg.warmup_steps, cfg.lr_schedule, cfg.min_lr_ratio))
    return opt, sched


def _fused_adam_ok(params: list[torch.nn.Parameter]) -> bool:
    """PyTorch's fused AdamW kernel (one pass, no parameter-sized temporaries: the unfused CPU
    step allocates one per tensor, 545 MB for a 152k x 896 embedding) for plain floating
    parameters on the CPU or CUDA; other devices and sharded (DTensor) parameters keep the
    default implementation."""
    return bool(params) and all(
        type(p) is torch.nn.Parameter and p.is_floating_point()
        and p.device.type in ("cpu", "cuda") for p in params)


def release_freed_memory() -> None:
    """Hand memory that was freed but kept by glibc's heap back to the OS (``malloc_trim``; a
    no-op elsewhere). Called before the first optimizer step on the CPU: the activations the
    backward pass just freed (331 MB at 152k vocab, 4 x 1,040 tokens) were still resident when
    AdamW allocated its two moments, and that sum was the step's peak RSS."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return
    trim(0)


def merged(model: Any) -> Any:
    """The plain model to save: LoRA adapters merged into the weights (peft), else `model`."""
    merge = getattr(model, "merge_and_unload", None)
    return merge() if callable(merge) and hasattr(model, "peft_config") else model


def save_checkpoint(model: Any, tokenizer: Any, path: str | Path,
                    state_dict: dict[str, Any] | None = None) -> Path:
    """Write a `from_pretrained`-loadable safetensors checkpoint atomically.

    The files go to a temporary sibling directory that is renamed into place only when complete,
    so a crash never leaves a half-written checkpoint under `path`. `state_dict`: the weights to
    write instead of the model's own (the gathered full weights of an FSDP2-sharded model).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    extra = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(tmp, safe_serialization=True, **extra)
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


def save_config(out_dir: str | Path, cfg: BaseConfig) -> None:
    import yaml

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX); True when torch
    cannot tell."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported",
                                                          "_is_amx_tile_supported")]
    if any(c is None for c in checks):
        return True
    return any(c() for c in checks)


def slow_bf16_warning(cfg: BaseConfig, device: torch.device) -> str | None:
    """A warning when `autocast_bf16` / `bf16_compute` will run on a CPU without bf16 matrix
    instructions: PyTorch then emulates bf16 matrix multiplies, 40-80x slower than fp32 (an AMD
    EPYC with AVX2 only: 1-2 GFLOP/s against 76-89 for fp32, docs/performance.md)."""
    if device.type != "cpu" or not (cfg.autocast_bf16 or cfg.bf16_compute) \
            or cpu_has_bf16_matmul():
        return None
    key = "bf16_compute" if cfg.bf16_compute else "autocast_bf16"
    return (f"config key '{key}': this CPU has no bf16 matrix instructions (AVX512-BF16 or AMX; "
            f"torch reports {torch.backends.cpu.get_cpu_capability()}), so bf16 matrix "
            "multiplies are emulated, 40-80x slower than fp32; turn it off on this machine")


VERIFIERS = ("math", "code")
"""Reward functions whose score >= 1.0 means "correct" (the verifiable rewards)."""


def first_verifier(names: list[str]) -> str | None:
    """The first verifiable reward (`math` / `code`) of `rewards:`, at any weight, or None."""
    return next((n for n in names if n in VERIFIERS), None)


def accuracy_metrics(scores: list[float], verdicts: list[float] | None) -> dict[str, float]:
    """`reward/frac_score_ge_1`: the fraction of scorable samples whose weighted score is
    >= 1.0 (whatever the rewards are); `reward/accuracy`: the fraction of the verifier's
    scorable verdicts that are >= 1.0, only when `verdicts` (the verifier's scores) is given."""
    valid = [s for s in scores if s == s]  # NaN: unscorable
    out = {"reward/frac_score_ge_1":
           sum(s >= 1.0 for s in valid) / len(valid) if valid else float("nan")}
    if verdicts is not None:
        ok = [v for v in verdicts if v == v]
        out["reward/accuracy"] = sum(v >= 1.0 for v in ok) / len(ok) if ok else float("nan")
    return out


def all_rejected_warning(name: str, step: int, cfg: Any, consequence: str) -> str:
    """The one line a trainer prints when its rollout correction rejected every sample."""
    return (f"[{name}] warning: step {step}: rollout_is={cfg.rollout_correction()} rejected "
            f"every sample (importance ratio above rollout_is_cap={cfg.rollout_is_cap}, see "
            f"rollout/*): {consequence}")
