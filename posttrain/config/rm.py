"""Reward-model configs: the outcome reward model (``posttrain rm``) and the process reward model
(``posttrain prm``). See docs/reward_models.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.config.base import BaseConfig, ConfigError, check_table
from posttrain.config.keys import RowKeys, StepKeys


@dataclass
class _RewardModelConfig(RowKeys, BaseConfig):
    eval_size: int = 100_000
    """Held-out rows evaluated (all of `eval_data` by default)."""
    lr: float = 1e-4

    def validate(self) -> None:
        super().validate()
        check_table(self, {
            "batch_size": (self.batch_size >= 1, "expected >= 1"),
            "micro_batch_size": (self.micro_batch_size >= 2, "expected >= 2 (sequences)"),
            "max_seq_len": (self.max_seq_len >= 2, "expected >= 2"),
            "lora_r": (self.lora_r == 0, "LoRA is not supported for reward models yet; use 0")})


@dataclass
class RMConfig(_RewardModelConfig):
    objective: Literal["bradley_terry", "binary"] = "bradley_terry"
    """Bradley-Terry on preference pairs, or binary correctness of single completions."""
    margin: float = 0.0
    """Bradley-Terry margin m in -log sigmoid(r_w - r_l - m); added to a row's `margin`."""
    token_level: bool = False
    """objective=binary only: the label is predicted at EVERY completion token (BCE averaged over
    a row's completion tokens, Cobbe et al. 2021), not at the last token only. The score is still
    read at the last real token, so the saved model is used the same way."""

    def validate(self) -> None:
        super().validate()
        if self.token_level and self.objective != "binary":
            raise ConfigError("config key 'token_level': needs objective=binary (got "
                              f"objective={self.objective!r})")


@dataclass
class PRMConfig(StepKeys, _RewardModelConfig):
    num_classes: Literal[2, 3] = 2
    """Step classes: 2 (bad / good; a neutral 0 label counts as good) or 3 (bad/neutral/good)."""
    step_split: str = "think"
    """How the reward model splits a completion into steps: 'think' (each ';'-separated part of
    <think>...</think>, then the <answer> tag) or a literal delimiter such as '\\n'. Saved with
    the model."""
    soft_labels: bool = False
    """Train on each row's `soft_labels` (fractions in [0, 1]: Math-Shepherd soft labels)."""
    classifier_dropout: float = 0.0
    """Dropout before the class head (HF's default for token classification is 0.1)."""

    def validate(self) -> None:
        super().validate()
        if self.soft_labels and self.num_classes != 2:
            raise ConfigError("config key 'soft_labels': needs num_classes=2")
        if not self.step_separator:
            raise ConfigError("config key 'step_separator': expected a non-empty string")
