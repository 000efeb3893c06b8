"""Padding accounting for `perf/pad_fraction`: padded positions / all positions the learner
computes in a step.

Every differentiated forward pass (the policy's, the critic's, a reward model's) reports its
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
    """Positions counted since the last `take`; the padded count stays on the mask's device
    until `take` (one read to the host a step, not one a forward pass)."""

    padded: int | Tensor = 0
    total: int = 0

    def take(self) -> tuple[int, int]:
        """(padded, total) so far; the count restarts at 0."""
        out = (int(self.padded), self.total)
        self.padded, self.total = 0, 0
        return out


PAD_COUNT = PadCount()


def count_positions(attention_mask: Tensor | None, positions: int = 0) -> None:
    """Add a forward pass's mask [n, L] (or, for a pass without padding, its `positions`) to
    `PAD_COUNT` when gradients are on (the learner)."""
    if torch.is_grad_enabled():
        if attention_mask is None:
            PAD_COUNT.total += positions
            return
        PAD_COUNT.padded = PAD_COUNT.padded + (attention_mask == 0).sum()
        PAD_COUNT.total += attention_mask.numel()
