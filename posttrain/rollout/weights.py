"""The policy's weights as an inference engine loads them: HF checkpoint names, bf16, buckets.

`iter_weights(model, bucket_bytes)` yields lists of (name, tensor) of at most about
`bucket_bytes` each (one tensor may exceed it alone), for

- a plain transformers model: its parameters and persistent buffers, under the names
  `save_pretrained` writes; a tied LM head once (the embedding's name);
- a LoRA (peft) model: the adapters merged into the base weights while they are read, then
  unmerged, and the base weights put back bit for bit from a copy taken before the merge (an
  unmerge alone subtracts in floating point and may not restore them exactly); names without
  peft's `base_model.model.` / `.base_layer` parts, adapter tensors left out;
- an FSDP2-sharded model: `full_tensor()` per parameter (a collective: every rank iterates,
  in the same order), names as the unsharded model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["hf_name", "iter_weights", "lora_merged", "named_weights"]

DEFAULT_BUCKET_BYTES = 512 * 2**20


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def hf_name(name: str) -> str | None:
    """A checkpoint name from a live module path: wrapper prefixes dropped (torch.compile's
    `_orig_mod.`, peft's `base_model.model.`, `.base_layer`, `modules_to_save.<adapter>`);
    None for tensors a checkpoint does not hold (LoRA adapters, peft's saved originals)."""
    parts = [p for p in name.split(".") if p != "_orig_mod"]
    if any(p.startswith("lora_") or p == "original_module" for p in parts):
        return None
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    out: list[str] = []
    skip = False
    for p in parts:
        if skip:  # the adapter name after `modules_to_save`
            skip = False
            continue
        if p == "modules_to_save":
            skip = True
            continue
        if p != "base_layer":
            out.append(p)
    return ".".join(out)


@contextlib.contextmanager
def lora_merged(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block a peft model's weights hold the merged adapters; on exit the adapters
    are unmerged and every base weight they touched is restored exactly from a copy."""
    if not _is_peft(model):
        yield model
        return
    layers = [m for m in model.modules()
              if hasattr(m, "base_layer") and callable(getattr(m, "merge", None))]
    saved = [(p, p.detach().clone()) for m in layers for p in m.base_layer.parameters()]
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()
        with torch.no_grad():
            for p, copy in saved:
                p.copy_(copy)


def _full(t: Tensor) -> Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor), else `t` itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def named_weights(model: torch.nn.Module, dtype: torch.dtype | None = torch.bfloat16,
                  tied: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, detached tensor) of every parameter and persistent buffer, tied
    parameters once (`tied`: under each of their names, e.g. the LM head tied to the
    embedding); floating-point tensors cast to `dtype` (None: as they are). A LoRA model must
    be inside `lora_merged` (`iter_weights` does that)."""
    seen: set[int] = set()
    persistent = set(model.state_dict().keys())
    tensors = [*model.named_parameters(remove_duplicate=False),
               *((n, b) for n, b in model.named_buffers(remove_duplicate=False)
                 if n in persistent)]
    for live, t in tensors:
        if id(t) in seen and not tied:
            continue
        seen.add(id(t))
        name = hf_name(live)
        if name is None:
            continue
        with torch.no_grad():  # a copy: a merged LoRA weight is restored after reading
            value = _full(t).detach()
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            value = value.to(cast, copy=True)
        yield name, value


def iter_weights(model: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: torch.dtype | None = torch.bfloat16, tied: bool = False
                 ) -> Iterator[list[tuple[str, Tensor]]]:
    """Buckets of (checkpoint name, `dtype` tensor) covering the model once (see the module
    doc; `tied` as `named_weights`); each bucket holds about `bucket_bytes` (at least one)."""
    with lora_merged(model):
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        for name, t in named_weights(model, dtype, tied):
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket
