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
