"""The frozen reference policy, and its precomputed log-prob tables with their cache.

:class:`ReferencePolicy` is where every trainer gets pi_ref from: a frozen copy of the policy
(full fine-tune), the policy with its LoRA adapters off, a bf16 copy under `bf16_compute`, or,
for a table computed before the first update, the policy itself. :meth:`ReferencePolicy.table`
computes such a table (DPO's per-pair log-probs) once and caches it at
``<ref_cache_dir>/<key>.safetensors`` (default ``out_dir/refcache``; a shared folder reuses
tables across runs). The key hashes the reference model (its weights' fingerprint when the
model object is given, else ``cfg.model``'s path, config and weight files), the tokenized pairs,
dtype and precision flags.
More: docs/dpo.md, "Module notes", posttrain.engine.reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from posttrain.config import BaseConfig
from posttrain.data.pairs import PairTensors
from posttrain.models import adapters_disabled
from posttrain.models.bf16_copy import BF16Copy

Columns = Callable[[torch.nn.Module, Tensor], dict[str, Tensor]]
"""(reference model, item indices [n]) -> named log-prob columns, each [n]."""


@dataclass
class ReferencePolicy:
    """pi_ref for one trainer: a loaded frozen copy, else the adapters-off policy (LoRA), else
    (``policy_before_update``, for tables computed before any update) the policy itself."""

    cfg: BaseConfig
    policy: Callable[[], torch.nn.Module]
    """The trainer's model as it is now (it may be wrapped after the reference is made)."""
    learner: Callable[[], torch.nn.Module]
    """The model the policy's passes run on (its bf16 copy under `bf16_compute`)."""
    sharded: bool = False
    """FSDP2 with a meta start: the copy is sharded like the policy (no bf16 copy of it)."""
    policy_before_update: bool = False
    updated: bool = False
    """Set after the first update: the policy is no longer the reference."""
    model: Any = None
    bf16: BF16Copy | None = None

    def load_copy(self) -> None:
        """A frozen in-memory copy of the policy as it is now (none with LoRA: not needed)."""
        if self.cfg.lora_r == 0:
            self.model = self.policy_copy()

    def policy_copy(self) -> torch.nn.Module:
        import copy

        return copy.deepcopy(self.policy()).eval().requires_grad_(False)

    @contextlib.contextmanager
    def use(self) -> Iterator[torch.nn.Module]:
        """The reference in eval mode, for the duration of the block."""
        if (self.model is not None and self.cfg.bf16_compute and self.bf16 is None
                and not self.sharded):
            # built like the learner, so the KL is exactly 0 before an update; the fp32 body is
            # freed (the copy shares only the fp32 head)
            self.bf16 = BF16Copy(self.model, compile_body=self.cfg.torch_compile)
            self.model = self.bf16.model
        if self.model is not None:
            yield self.model
            return
        policy = self.policy()
        if self.cfg.lora_r == 0 and not self.policy_before_update:
            raise RuntimeError("no reference model loaded: call load_reference() in setup()")
        if self.cfg.lora_r == 0 and self.updated:
            raise RuntimeError("the policy is no longer the reference after an update; set "
                               "precompute_ref: true or keep a reference model")
        was_training = policy.training
        policy.eval()
        try:
            if self.cfg.lora_r > 0:
                with adapters_disabled(policy) as base:
                    yield base
            else:
                yield self.learner()  # the policy (its bf16 copy under bf16_compute), eval mode
        finally:
            policy.train(was_training)

    @torch.no_grad()
    def table(self, path: Path, n: int, micro: int, columns: Columns, keys: tuple[str, ...],
              meta: dict[str, str]) -> tuple[dict[str, Tensor], str]:
        """Reference columns ``keys`` for items ``0 .. n-1`` (each -> [n], fp32 on the CPU):
        read from ``path`` when a complete table is there, else computed in micro-batches of
        ``micro`` items and written atomically. Returns the table and ``"hit|miss <path>"``."""
        if path.is_file():
            table = load_file(str(path))
            if set(table) == set(keys) and all(v.shape[0] == n for v in table.values()):
                return table, f"hit {path}"
        parts: dict[str, list[Tensor]] = {}
        with self.use() as ref:
            for idx in torch.arange(n).split(micro):
                for k, v in columns(ref, idx).items():
                    parts.setdefault(k, []).append(v)
        result = {k: torch.cat(v).float().cpu().contiguous() for k, v in parts.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # torchrun ranks write it concurrently
        save_file(result, str(tmp), metadata=meta)
        os.replace(tmp, path)
        return result, f"miss {path}"


def model_fingerprint(model: str) -> str:
    """Path + config.json + weight files' names/sizes/mtimes (a Hub name: the name itself)."""
    path = Path(model)
    if not path.is_dir():
        return model
    parts = [str(path.resolve())]
    if (path / "config.json").is_file():
        parts.append((path / "config.json").read_text())
    for f in sorted(path.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt"):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every tensor of ``model.state_dict()`` (name, dtype, shape and bytes).

    LoRA adapter tensors are left out: the reference is the model with its adapters off.
    """
    h = hashlib.blake2b(digest_size=20)
    for name, tensor in sorted(model.state_dict().items()):
        if "lora_" in name or not isinstance(tensor, torch.Tensor):
            continue
        t = tensor.detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"weights:{h.hexdigest()}"


def ref_cache_path(cfg: BaseConfig, source: str, pairs: PairTensors,
                   model: torch.nn.Module | None = None) -> Path:
    """Where the reference table of ``pairs`` (loaded from ``source``) is cached.

    ``model``: the reference model object; when given, the key hashes its weights instead of
    ``cfg.model``.
    """
    h = hashlib.sha256()
    precision = [str(cfg.autocast_bf16)] + (["bf16_compute"] if cfg.bf16_compute else [])
    fingerprint = weights_fingerprint(model) if model is not None else model_fingerprint(
        cfg.model)
    for part in (fingerprint, cfg.dtype, *precision, pairs.digest()):
        h.update(part.encode())
        h.update(b"\0")
    folder = Path(cfg.ref_cache_dir) if cfg.ref_cache_dir else Path(cfg.out_dir) / "refcache"
    return folder / f"{h.hexdigest()[:32]}.safetensors"
