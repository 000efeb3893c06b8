"""Padding accounting for `perf/pad_fraction`: padded positions / all positions the learner
computes in a step.

Every differentiated forward pass (the policy's, the critic's, a scorer's) reports its
attention mask with `count_positions` after its all-padding columns are trimmed; no-grad passes
(rollout, reference, old log-probs, evaluation) are not counted. The loop (`Trainer`) resets the
count before a step and reads it after, summed over ranks. A packed pass reports a mask of ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def pad_positions(attention_mask: Tensor) -> tuple[int, int]:
    """(padded positions, all positions) of a model input's attention mask [n, L] (0 = pad)."""
    return int((attention_mask == 0).sum()), int(attention_mask.numel())


@dataclass
class PadCount:
    """Positions counted since the last `take`."""

    padded: int = 0
    total: int = 0

    def take(self) -> tuple[int, int]:
        """(padded, total) so far; the count restarts at 0."""
        out = (self.padded, self.total)
        self.padded = self.total = 0
        return out


PAD_COUNT = PadCount()


def count_positions(attention_mask: Tensor) -> None:
    """Add a forward pass's mask [n, L] to `PAD_COUNT` when gradients are on (the learner)."""
    if torch.is_grad_enabled():
        padded, total = pad_positions(attention_mask)
        PAD_COUNT.padded += padded
        PAD_COUNT.total += total
