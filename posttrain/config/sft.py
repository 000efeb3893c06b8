"""SFT config: the supervised warm start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.base import BaseConfig, ConfigError, check_generation_budget, math_and_format


@dataclass
class SFTConfig(BaseConfig):
    train_data: str = ""
    """SFT rows {"prompt", "completion"} (JSONL path or `datasets` name)."""
    train_split: str = "train"
    """Split name when `train_data` is a `datasets` name."""
    batch_size: int = 64
    """Sequences per optimizer step."""
    max_seq_len: int = 256
    """Longest prompt+completion kept, in tokens (longer rows are an error, not silently cut)."""
    max_new_tokens: int = 64
    """Generation budget for held-out evaluation."""
    rewards: list[dict[str, Any]] = field(default_factory=math_and_format)
    """Reward functions used to score held-out greedy samples (evaluation only)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradient accumulation; the update is the same for any
    value); 0: the whole batch at once. 8 (TRL's per-device default) is sized for a GPU: a
    whole batch of 64 x 1k tokens at a 151,936 vocabulary does not fit one; on a CPU with a
    tiny model 0 is faster."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = 100
    """Linear warm-up from 0 to `lr` over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """Floor of the decayed learning rate, as a fraction of `lr`."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""

    def validate(self) -> None:
        super().validate()
        check_generation_budget(self, "max_new_tokens")
        for key in ("batch_size", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}'={getattr(self, key)}: expected >= 1")
        if self.micro_batch_size < 0:
            raise ConfigError(f"config key 'micro_batch_size'={self.micro_batch_size}: "
                              "expected >= 0 (0: the whole batch)")
