"""Keys several configs share, each declared once (a config lists these before `BaseConfig`,
e.g. ``class SFTConfig(HeldOutKeys, RowKeys, BaseConfig)``); a config re-declares one only to
change its default (tests/engine/test_values.py checks both)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.base import math_and_format


@dataclass
class MicroBatchKeys:
    micro_batch_size: int = 16
    """Sequences per forward/backward (gradient accumulation; the update is the same for any
    value), as in every trainer: a preference pair is two sequences (chosen and rejected in one
    forward), so a micro-batch holds half as many pairs. 16 (8 pairs, TRL's per-device default)
    is sized for a GPU; on a CPU with a tiny model 64 or more is faster."""


@dataclass
class GenerationBatchKeys:
    generation_batch_size: int = 0
    """Sequences per generation batch, a memory bound (the samples do not change; it bounds the
    KV cache and the logits of a decode step on a GPU). RL trainers: a step's rollouts in whole
    groups (rounded down to a multiple of group_size, at least one group); 0: all of a rank's
    sequences in one batch. search: also the completions per verifier forward pass."""


@dataclass
class RowKeys(MicroBatchKeys):
    batch_size: int = 32
    """Rows per optimizer step: preference pairs (dpo, rm), rows (kto, rm objective=binary),
    step rows (prm)."""
    max_seq_len: int = 256
    """Longest prompt+completion (or prompt+steps) in tokens; longer rows are an error, not
    silently cut."""


@dataclass
class EvalKeys:
    eval_max_new_tokens: int = 64
    """Generation budget for held-out greedy evaluation (every trainer that evaluates by
    generating; `max_new_tokens` is the sampling budget of the trainers that sample)."""


@dataclass
class HeldOutKeys(EvalKeys):
    eval_rewards: list[dict[str, Any]] = field(default_factory=math_and_format)
    """Reward functions that score held-out greedy samples (evaluation only; nothing trains on
    them): the entries `rewards` takes in the RL trainers."""


@dataclass
class StepKeys:
    step_separator: str = "\n"
    """The text that ends a reasoning step: appended after every step of a PRM's rows (the
    step's prediction is read at its last token); where search's beam search stops generating a
    step (there a boundary of the PRM's saved split rule)."""


@dataclass
class PromptKeys:
    prompt_field: str = "prompt"
    """Row field holding the prompt (str or list of chat messages); another name is read as
    `columns: {prompt: <name>}`."""
    answer_field: str = "answer"
    """Row field holding the gold answer, passed to reward functions as `answer` (search: used
    only to measure accuracy)."""
    answer_marker: str = ""
    """If set, the gold answer is the text after the last occurrence of this marker in the
    answer field (GSM8K solutions end with "#### 72": use "####")."""
    max_new_tokens: int = 64
    """Longest completion sampled; longer ones are truncated and flagged (search: a solution,
    and a beam-search step)."""
    temperature: float = 1.0
    """Sampling temperature (RL: log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling; 1.0 disables."""


@dataclass
class PolicyGradientKeys:
    """Keys of the clipped policy-gradient trainers (GRPO's defaults; PPO changes them)."""

    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = (
        "seq-mean-token-mean"
    )
    """Loss aggregation: GRPO paper, DAPO token-mean, or Dr. GRPO sum / (N * max_new_tokens)."""
    kl_coef: float = 0.0
    """beta. 0 loads no reference model and runs no reference forward pass."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (k3 = DeepSeekMath)."""
    mini_batches: int = 1
    """Optimizer steps per pass over a rollout batch."""


DPO_LOSS_TYPES = ("sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo")  # dpo, online_dpo
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
LossType = Literal["sigmoid", "cdpo", "robust", "ipo", "hinge", "simpo", "kto", "apo_zero_unpaired"]


@dataclass
class PreferenceLossKeys:
    loss_type: LossType = "sigmoid"
    """The loss, by TRL's name for it (docs/algorithms.md). dpo, online_dpo: sigmoid | cdpo |
    robust | ipo | hinge | simpo (ipo averages log-probs over tokens; simpo averages them and
    uses no reference model: none is loaded or precomputed). kto: kto (KTO paper eq. 7, the
    reference point from mismatched pairs) | apo_zero_unpaired (APO-zero without a reference
    point, as TRL's KTO trainer)."""
    beta: float = 0.1
    """beta: scale of the implicit reward beta * (logp - logp_ref), the strength of the KL
    anchor to the reference (SimPO: the reward scale)."""

    def loss_type_check(self, choices: tuple[str, ...]) -> dict[str, tuple[bool, str]]:
        """`check_table`'s row for this trainer's own `loss_type` choices."""
        return {"loss_type": (self.loss_type in choices, f"expected one of {list(choices)}")}
