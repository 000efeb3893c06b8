"""Block sizes and matmul precision of the fused LM head (`posttrain.ops.fused_head`).

A logits block holds `DEFAULT_BLOCK_ELEMENTS` fp32 values on the CPU (32 MB) and up to
`GPU_BLOCK_ELEMENTS` (512 MB) on a GPU, where fewer, larger matmuls over the head weight are
what is fast. `head_precision` selects the head's matmul arithmetic for the calls inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

# fp32 elements of one [rows, V] logits block on the CPU (8M elements = 32 MB)
DEFAULT_BLOCK_ELEMENTS = 1 << 23
GPU_BLOCK_ELEMENTS = 1 << 27  # 128M elements = 512 MB, at most 1/64 of the GPU's memory
HEAD_PRECISIONS = ("fp32", "tf32", "bf16")
_PRECISION: ContextVar[str] = ContextVar("head_precision", default="fp32")


def device_block_elements(device_type: str, total_memory: int = 0) -> int:
    """fp32 elements of one logits block: `DEFAULT_BLOCK_ELEMENTS` on the CPU; on a GPU with
    `total_memory` bytes, `GPU_BLOCK_ELEMENTS` capped at 1/64 of the memory (the backward
    holds about three blocks at once)."""
    if device_type == "cpu":
        return DEFAULT_BLOCK_ELEMENTS
    cap = total_memory // (64 * 4) if total_memory > 0 else GPU_BLOCK_ELEMENTS
    return max(DEFAULT_BLOCK_ELEMENTS, min(GPU_BLOCK_ELEMENTS, cap))


def block_elements_for(device: torch.device) -> int:
    """`device_block_elements` of `device` (its total memory read once per call on CUDA)."""
    total = (torch.cuda.get_device_properties(device).total_memory
             if device.type == "cuda" else 0)
    return device_block_elements(device.type, total)


def current_head_precision() -> str:
    """The precision set by the innermost `head_precision` context (fp32 outside any)."""
    return _PRECISION.get()


@contextlib.contextmanager
def head_precision(mode: str) -> Iterator[None]:
    """Every `head_logprobs` call inside runs at `mode` (one of `HEAD_PRECISIONS`) unless it
    names its own `precision`; the trainers set config key `head_precision` around each step."""
    if mode not in HEAD_PRECISIONS:
        raise ValueError(f"head precision {mode!r}: expected one of {HEAD_PRECISIONS}")
    token = _PRECISION.set(mode)
    try:
        yield
    finally:
        _PRECISION.reset(token)


@contextlib.contextmanager
def matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    """TF32 for CUDA fp32 matmuls inside when `precision` is tf32 (restored on exit)."""
    if precision != "tf32" or device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    name, value = (("fp32_precision", "tf32") if hasattr(flags, "fp32_precision")
                   else ("allow_tf32", True))  # torch >= 2.9 / older
    before = getattr(flags, name)
    setattr(flags, name, value)
    try:
        yield
    finally:
        setattr(flags, name, before)


def mm_fp32_out(a: Tensor, b: Tensor) -> Tensor:
    """a [r, k] @ b [k, c] on bf16 inputs with fp32 accumulation and an fp32 result. On the CPU
    (no mixed-dtype matmul) the bf16-rounded inputs are multiplied in fp32: products of bf16
    values are exact in fp32, so it is the same arithmetic up to summation order."""
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    if a.device.type == "cuda" and _MIXED_MM[0]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without bf16 -> fp32 mm: same arithmetic
            _MIXED_MM[0] = False
    return a.float() @ b.float()


_MIXED_MM = [True]  # whether torch.mm(..., out_dtype=float32) works on CUDA here


def block_rows(n_rows: int, vocab: int, block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> int:
    """Rows per block so that one [rows, V] fp32 block holds at most `block_elements` floats."""
    return max(1, min(n_rows, block_elements // max(vocab, 1)))
