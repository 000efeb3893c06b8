"""Where DPO's precomputed reference log-probs are cached, and when a cache is stale.

``<ref_cache_dir>/<key>.safetensors``; ``ref_cache_dir`` defaults to ``out_dir/refcache``, so the
data folder may be read-only and a resumed run finds its table. Point ``ref_cache_dir`` at a
shared folder to reuse tables across runs.

The key hashes the reference model, the tokenized pairs (so any change of data, tokenizer or chat
template invalidates it), dtype and precision flags. The model part is a fingerprint of the
actual weights when the model object is given (an in-memory model, or one fine-tuned in memory
that still carries its base's ``name_or_path``, gets its own key), else of ``cfg.model`` (path,
config.json, weight files' names/sizes/mtimes; a Hub name: the name itself).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from posttrain.config import DPOConfig
from posttrain.data.pairs import PairTensors


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


def ref_cache_path(cfg: DPOConfig, source: str, pairs: PairTensors,
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
