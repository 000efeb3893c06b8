"""DPO config: preference optimisation without a reward model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.base import BaseConfig, ConfigError, check_generation_budget, math_and_format


@dataclass
class DPOConfig(BaseConfig):
    train_data: str = ""
    """Preference rows {"prompt", "chosen", "rejected"} (JSONL path or `datasets` name)."""
    train_split: str = "train"
    """Split name when `train_data` is a `datasets` name."""
    eval_pref_data: str = ""
    """Held-out preference rows for implicit-reward accuracy; empty: none."""
    beta: float = 0.1
    """DPO beta: strength of the implicit KL anchor to the reference."""
    loss_type: Literal["sigmoid", "cdpo", "robust", "ipo", "hinge"] = "sigmoid"
    """Preference loss (docs/algorithms.md); ipo averages log-probs over tokens."""
    label_smoothing: float = 0.0
    """Assumed label-noise rate s for cdpo / robust; sigmoid honours it too (then = cdpo, as in
    OpenRLHF; TRL 1.16's sigmoid ignores it: docs/algorithms.md)."""
    rpo_alpha: float = 0.0
    """Weight of the chosen completion's NLL (mean over its tokens) added to each pair's loss:
    RPO, Pang et al. 2024 (arXiv:2404.19733) eq. 1. Keeps the chosen log-probs from falling;
    0 disables."""
    batch_size: int = 32
    """Preference pairs per optimizer step."""
    micro_batch_size: int = 16
    """Sequences per forward/backward (gradient accumulation), as in every trainer: a pair is
    two sequences (chosen and rejected in one forward), so a micro-batch holds half as many
    pairs. 16 (8 pairs, TRL's per-device default) is sized for a GPU; on a CPU with a tiny
    model 64 or more is faster."""
    max_seq_len: int = 256
    """Longest prompt+completion in tokens; longer rows are an error."""
    precompute_ref: bool = True
    """Compute reference log-probs once for the whole dataset (cached in `ref_cache_dir`, keyed
    by a hash of the model's weights and of the tokenized pairs) instead of a reference forward
    pass every step."""
    ref_cache_dir: str = ""
    """Folder of the precomputed reference tables; empty: `out_dir/refcache`. Set a shared
    folder to reuse a table across runs (the key changes with the weights and the data)."""
    max_new_tokens: int = 64
    """Generation budget for held-out greedy evaluation."""
    rewards: list[dict[str, Any]] = field(default_factory=math_and_format)
    """Reward functions used to score held-out greedy samples (evaluation only)."""
    lr: float = 5e-6
    """Peak learning rate (AdamW)."""

    def validate(self) -> None:
        super().validate()
        check_generation_budget(self, "max_new_tokens")
        checks = {
            "beta": (self.beta > 0, "expected > 0"),
            "batch_size": (self.batch_size >= 1, "expected >= 1"),
            "micro_batch_size": (self.micro_batch_size >= 2,
                                 "expected >= 2 (sequences; one pair is 2 sequences)"),
            "label_smoothing": (0.0 <= self.label_smoothing < 0.5, "expected in [0, 0.5)"),
            "lora_r": (self.lora_r >= 0, "expected >= 0 (0 trains all weights)"),
            "rpo_alpha": (self.rpo_alpha >= 0, "expected >= 0 (0 disables the NLL term)"),
        }
        for key, (ok, msg) in checks.items():
            if not ok:
                raise ConfigError(f"config key '{key}'={getattr(self, key)!r}: {msg}")

