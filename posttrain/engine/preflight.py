"""Every check of the device, the precision and a trainer's capabilities, made before any model
loads: `preflight` runs them all (the config's own checks, `posttrain.config`, never probe the
hardware). A refusal is one :class:`ConfigError` line naming the config key; a slow but valid
set-up (bf16 emulated on a CPU without bf16 instructions) is a warning.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from posttrain.config import BaseConfig, ConfigError
from posttrain.core.device import cuda_bf16_native, process_device, resolve_device


def preflight(cfg: BaseConfig, trainer: Any = None) -> str | None:
    """Refuse what this machine or `trainer` (a Trainer class: its name, `supports_fsdp`,
    `supports_bf16_compute`) cannot run; returns the slow-bf16 warning, if any."""
    check_device(cfg.device)
    check_bf16_device(cfg)
    if trainer is not None:
        check_bf16_compute(cfg, trainer.supports_bf16_compute, trainer.name)
        if cfg.fsdp and cfg.lora_r > 0:
            raise ConfigError("config keys 'fsdp' and 'lora_r': FSDP2 with LoRA is not "
                              "supported; use data parallel (fsdp: false) for LoRA runs")
        # a trainer class says True in `supports_token_budget` / `supports_packing`
        for key, on, ok in (
                ("micro_batch_tokens", cfg.micro_batch_tokens,
                 getattr(trainer, "supports_token_budget", False)),
                ("packing", cfg.packing, getattr(trainer, "supports_packing", False))):
            if on and not ok:
                raise ConfigError(f"config key '{key}': `posttrain {trainer.name}` does not "
                                  f"support it yet; remove it (docs/performance.md)")
        if cfg.fsdp and not trainer.supports_fsdp:
            raise ConfigError(f"config key 'fsdp': `posttrain {trainer.name}` does not support "
                              "FSDP2 yet; use data parallel (fsdp: false)")
    return slow_bf16_warning(cfg, resolve_device(cfg.device))


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


def check_device(device: str) -> None:
    """A device this torch build can use (under torchrun: the rank's own GPU), before any
    model loads (not an AssertionError)."""
    if device == "auto" and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return  # one process: nothing to check (and no torch import)
    if device != "auto":
        try:
            dev = torch.device(device)
        except RuntimeError as err:
            raise ConfigError(f"config key 'device'={device!r}: expected auto, cpu, cuda or "
                              f"cuda:N ({err})") from err
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"config key 'device'={device!r}: no CUDA device is available to "
                              f"this torch build ({torch.__version__}); use device: cpu or auto")
        if dev.type == "cuda" and dev.index is not None \
                and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"config key 'device'={device!r}: only "
                              f"{torch.cuda.device_count()} CUDA device(s) are visible")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        process_device(device, os.environ, count)
    except ValueError as err:
        raise ConfigError(f"config key 'device'={device!r}: {err}") from err

def bf16_device_error(cfg: BaseConfig, device_type: str, native_bf16: bool) -> str | None:
    """The one line refusing the first bf16 option of `cfg` on a CUDA device without native
    bf16 (`native_bf16` False: compute capability < 8.0), else None (pure function)."""
    if device_type != "cuda" or native_bf16:
        return None
    keys = [("dtype", cfg.dtype == "bfloat16"), ("autocast_bf16", cfg.autocast_bf16),
            ("bf16_compute", cfg.bf16_compute),
            ("head_precision", cfg.head_precision == "bf16")]
    key = next((k for k, on in keys if on), None)
    if key is None:
        return None
    return (f"config key '{key}': this GPU has no native bf16 (compute capability below 8.0, "
            "e.g. V100 or T4; torch.cuda.is_bf16_supported(including_emulation=False) is "
            "False), so bf16 would be emulated or fail; use fp32 (and tf32 where offered)")

def check_bf16_device(cfg: BaseConfig) -> None:
    """`bf16_device_error` on the device this process will use."""
    if not (cfg.dtype == "bfloat16" or cfg.autocast_bf16 or cfg.bf16_compute
            or cfg.head_precision == "bf16"):
        return
    device = resolve_device(cfg.device)
    native = device.type != "cuda" or cuda_bf16_native(device)
    if (err := bf16_device_error(cfg, device.type, native)) is not None:
        raise ConfigError(err)


def check_bf16_compute(cfg: BaseConfig, supported: bool, name: str) -> None:
    """`bf16_compute` only where the trainer supports it, not with LoRA; with FSDP2 (its bf16
    mixed precision, `posttrain.engine.fsdp`) only on CUDA and without torch_compile."""
    if cfg.torch_compile and not cfg.bf16_compute:
        raise ConfigError("config key 'torch_compile': needs bf16_compute: true (it compiles "
                          "the bf16 learner and reference copies)")
    if not cfg.bf16_compute:
        return
    if not supported:
        raise ConfigError(f"config key 'bf16_compute': not supported by `posttrain {name}` yet "
                          "(grpo and dpo support it); use autocast_bf16")
    if cfg.lora_r > 0:
        raise ConfigError("config key 'bf16_compute': needs a full fine-tune (lora_r: 0); use "
                          "autocast_bf16")
    if cfg.fsdp and resolve_device(cfg.device).type != "cuda":
        raise ConfigError(f"config keys 'bf16_compute' and 'fsdp': FSDP2's bf16 mixed "
                          f"precision runs on CUDA only (device: {cfg.device} is the CPU); use "
                          "autocast_bf16 or fsdp: false")
    if cfg.fsdp and cfg.torch_compile:
        raise ConfigError("config keys 'torch_compile' and 'fsdp': torch_compile compiles the "
                          "bf16 copies, which FSDP2's mixed precision replaces; set one")
