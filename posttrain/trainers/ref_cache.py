"""Where DPO's precomputed reference log-probs are cached, and when a cache is stale.

``<data file>.refcache/<key>.safetensors`` (under ``out_dir/refcache`` for a ``datasets`` name).
The key hashes the model (path, config.json, weight files' names/sizes/mtimes), the tokenized
pairs (so any change of data, tokenizer or chat template invalidates it), dtype and autocast.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def ref_cache_path(cfg: DPOConfig, source: str, pairs: PairTensors) -> Path:
    """Where the reference table of ``pairs`` (loaded from ``source``) is cached."""
    h = hashlib.sha256()
    precision = [str(cfg.autocast_bf16)] + (["bf16_compute"] if cfg.bf16_compute else [])
    for part in (model_fingerprint(cfg.model), cfg.dtype, *precision, pairs.digest()):
        h.update(part.encode())
        h.update(b"\0")
    src = Path(source)
    folder = (src.parent / f"{src.name}.refcache" if src.is_file()
              else Path(cfg.out_dir) / "refcache")
    return folder / f"{h.hexdigest()[:32]}.safetensors"
