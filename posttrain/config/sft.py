"""SFT config: the supervised warm start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.config.base import BaseConfig, check_generation_budget, check_table
from posttrain.config.keys import HeldOutKeys, RowKeys


@dataclass
class SFTConfig(HeldOutKeys, RowKeys, BaseConfig):
    batch_size: int = 64
    """Sequences per optimizer step."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradient accumulation; the update is the same for any
    value); 0: the whole batch at once. 8 (TRL's per-device default) is sized for a GPU: a
    whole batch of 64 x 1k tokens at a 151,936 vocabulary does not fit one; on a CPU with a
    tiny model 0 is faster."""
    lr: float = 1e-3
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])

    def validate(self) -> None:
        super().validate()
        check_generation_budget(self, "eval_max_new_tokens")
        check_table(self, {
            "batch_size": (self.batch_size >= 1, "expected >= 1"),
            "max_seq_len": (self.max_seq_len >= 1, "expected >= 1"),
            "micro_batch_size": (self.micro_batch_size >= 0, "expected >= 0 (0: the whole batch)")})
