"""Device resolution (one process or a torchrun rank), the process-group backend, and the
bf16 autocast context."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import torch


def under_torchrun(env: Mapping[str, str]) -> bool:
    """Whether `env` is a torchrun rank's environment (more than one process)."""
    return int(env.get("WORLD_SIZE", "1")) > 1


def process_device(name: str, env: Mapping[str, str], cuda_count: int) -> str:
    """The device string this process runs on, from config key `device` (pure function).

    One process: `auto` -> ``cuda`` when `cuda_count` > 0, else ``cpu``; anything else as given.
    Under torchrun (``WORLD_SIZE`` > 1 in `env`) every rank uses the GPU of its
    ``LOCAL_RANK`` (index 0 when each rank sees a single GPU, e.g. ``CUDA_VISIBLE_DEVICES`` set
    per rank): `auto` and `cuda` resolve to it, ``cuda:N`` is accepted only when N is that
    index, and `cpu` stays ``cpu``. Raises ValueError (one line) for any other choice.
    """
    if not under_torchrun(env):
        if name == "auto":
            return "cuda" if cuda_count > 0 else "cpu"
        return name
    if name == "cpu" or (name == "auto" and cuda_count == 0):
        return "cpu"
    local = int(env.get("LOCAL_RANK", "0"))
    if cuda_count > local:
        index = local
    elif cuda_count == 1:
        index = 0
    else:
        raise ValueError(f"LOCAL_RANK {local} has no GPU of its own ({cuda_count} visible); "
                         "start at most one rank per GPU")
    if name in ("auto", "cuda") or name == f"cuda:{index}":
        return f"cuda:{index}"
    raise ValueError(f"under torchrun each rank runs on the GPU of its LOCAL_RANK (this rank: "
                     f"cuda:{index}); use device: auto or cuda, not {name!r}")


def process_group_backend(device: torch.device | str) -> str:
    """The one process group's backend: gloo for CPU tensors, plus NCCL for CUDA tensors when
    the process runs on a GPU (so a CPU tensor never goes to NCCL)."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def resolve_device(name: str) -> torch.device:
    """Config key `device` for this process (`process_device` on the real environment)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device(process_device(name, os.environ, count))


def cuda_bf16_native(device: torch.device | str) -> bool:
    """Whether a CUDA `device` computes bf16 natively (compute capability >= 8.0, or ROCm);
    ``torch.cuda.is_bf16_supported`` without emulation, for that device."""
    device = torch.device(device)
    if torch.version.hip:
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).major >= 8


def reset_gpu_peak(device: torch.device | str) -> None:
    """Start a new peak for `gpu_memory_metrics` (a no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gpu_memory_metrics(device: torch.device | str) -> dict[str, float]:
    """CUDA memory of this process on `device` since the last `reset_gpu_peak`, in MB:
    ``gpu/max_allocated_mb`` (peak of tensors) and ``gpu/reserved_mb`` (held by the caching
    allocator now); empty off CUDA."""
    if torch.device(device).type != "cuda":
        return {}
    mb = 1024.0 * 1024.0
    return {"gpu/max_allocated_mb": torch.cuda.max_memory_allocated(device) / mb,
            "gpu/reserved_mb": torch.cuda.memory_reserved(device) / mb}


def autocast_ctx(
    enabled: bool, device: torch.device | str = "cpu"
) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` (by its device type) when enabled, else a no-op context."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
