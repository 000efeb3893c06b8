"""Device resolution and the bf16 autocast context."""

from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; anything else as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_ctx(
    enabled: bool, device: torch.device | str = "cpu"
) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` (by its device type) when enabled, else a no-op context."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
