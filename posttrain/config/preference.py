"""The preference family's configs: DPO (and SimPO) and KTO on offline rows, online DPO on
prompts."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.base import BaseConfig, ConfigError, check_generation_budget, check_table
from posttrain.config.keys import (
    DPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
    HeldOutKeys,
    LossType,
    PreferenceLossKeys,
    RowKeys,
)
from posttrain.config.rl import PromptRLConfig


@dataclass
class DPOLossConfig(PreferenceLossKeys):
    """The DPO-family loss keys, shared by `posttrain dpo` and `posttrain online_dpo`."""

    label_smoothing: float = 0.0
    """Assumed label-noise rate s for cdpo / robust / simpo; sigmoid honours it too (then = cdpo,
    as in OpenRLHF; TRL 1.16's sigmoid ignores it: docs/algorithms.md)."""
    simpo_gamma: float = 0.0
    """SimPO's target reward margin (TRL's name too; the paper uses 0.5-1.6 with beta 2-2.5);
    the other losses take none (a nonzero value is refused)."""
    rpo_alpha: float = 0.0
    """Weight of the chosen completion's NLL (mean over its tokens) added to each pair's loss:
    RPO, Pang et al. 2024 (arXiv:2404.19733) eq. 1 (CPO's BC term with simpo). Keeps the chosen
    log-probs from falling; 0 disables."""

    def check_loss(self) -> None:
        check_table(self, {
            **self.loss_type_check(DPO_LOSS_TYPES),
            "beta": (self.beta > 0, "expected > 0"),
            "label_smoothing": (0.0 <= self.label_smoothing < 0.5, "expected in [0, 0.5)"),
            "rpo_alpha": (self.rpo_alpha >= 0, "expected >= 0 (0 disables the NLL term)"),
        })


@dataclass
class PairsConfig(HeldOutKeys, RowKeys, BaseConfig):
    """Offline preference training on a fixed dataset (DPO, KTO)."""

    precompute_ref: bool = True
    """Compute reference log-probs once for the whole dataset (cached in `ref_cache_dir`, keyed
    by a hash of the model's weights and of the tokenized pairs) instead of a reference forward
    pass every step."""
    ref_cache_dir: str = ""
    """Folder of the precomputed reference tables; empty: `out_dir/refcache`. Set a shared
    folder to reuse a table across runs (the key changes with the weights and the data)."""
    lr: float = 5e-6

    def validate(self) -> None:
        super().validate()
        check_generation_budget(self, "eval_max_new_tokens")
        check_table(self, {
            "batch_size": (self.batch_size >= 1, "expected >= 1"),
            "micro_batch_size": (self.micro_batch_size >= 2,
                                 "expected >= 2 (sequences; one pair is 2 sequences)"),
            "lora_r": (self.lora_r >= 0, "expected >= 0 (0 trains all weights)"),
        })


@dataclass
class DPOConfig(DPOLossConfig, PairsConfig):
    eval_pref_data: str = ""
    """Held-out preference rows for implicit-reward accuracy; empty: none."""

    def validate(self) -> None:
        super().validate()
        self.check_loss()


@dataclass
class KTOConfig(PreferenceLossKeys, PairsConfig):
    loss_type: LossType = "kto"
    desirable_weight: float = 1.0
    """lambda_D: weight of a desirable row's loss (raise it when desirable rows are rarer)."""
    undesirable_weight: float = 1.0
    """lambda_U: weight of an undesirable row's loss."""

    def validate(self) -> None:
        super().validate()
        check_table(self, {
            **self.loss_type_check(KTO_LOSS_TYPES),
            "beta": (self.beta > 0, "expected > 0"),
            "desirable_weight": (self.desirable_weight >= 0, "expected >= 0"),
            "undesirable_weight": (self.undesirable_weight >= 0, "expected >= 0"),
            "batch_size": (self.batch_size >= 2 or self.loss_type != "kto",
                           "expected >= 2: KTO's reference point needs mismatched pairs"),
        })


@dataclass
class OnlineDPOConfig(DPOLossConfig, PromptRLConfig):
    group_size: int = 2
    """G: completions sampled per prompt (>= 2); the best and the worst by `rewards` form the
    pair (TRL samples 2)."""
    micro_batch_size: int = 16  # a pair is two sequences
    lr: float = 5e-7  # TRL's online DPO default

    def validate(self) -> None:
        super().validate()
        self.check_loss()
        check_table(self, {
            "group_size": (self.group_size >= 2, "expected >= 2 (a pair per prompt)"),
            "prompts_per_step": (self.prompts_per_step >= 1, "expected >= 1"),
            "micro_batch_size": (self.micro_batch_size >= 2,
                                 "expected >= 2 (sequences; one pair is 2 sequences)"),
            "rollout_is": (self.rollout_is in ("auto", "none"),
                           "online DPO has no importance ratio: leave it at auto / none"),
        })
        unused = ("clip_eps_low", "clip_eps_high", "dual_clip", "kl_clamp")
        for key in unused:  # PromptRLConfig's policy-gradient keys: not part of this loss
            if getattr(self, key) != PromptRLConfig.__dataclass_fields__[key].default:
                raise ConfigError(f"config key '{key}': not used by online DPO (no importance "
                                  "ratio or per-token KL); leave it at its default")
