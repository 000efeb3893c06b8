"""Process set-up: seeds and CPU threads."""

from __future__ import annotations

import random

import torch


def set_seed(seed: int) -> torch.Generator:
    """Seed python, torch (and numpy if present); return a CPU torch.Generator.

    The generator drives data order and, through a seed drawn from it, sampling on any device
    (the rollout derives a generator on the model's device).
    """
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


def sequence_seed(*keys: int | str) -> int:
    """A 63-bit seed from keys such as (seed, step, prompt index, sample index): draws made with
    it depend on those keys only, not on batch composition, rank count or resume point."""
    import hashlib

    digest = hashlib.blake2b(":".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
