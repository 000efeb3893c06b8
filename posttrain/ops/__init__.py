"""Pure tensor math of post-training: every formula of docs/algorithms.md as a small function.

Imports torch only (never transformers/peft/datasets). Notation used across the modules:
B prompts, G samples per prompt, N = B*G sequences, T response tokens, V vocabulary.
See docs/algorithms.md for the paper -> formula -> function index.
"""

from posttrain.ops.advantages import (
    gae,
    group_advantages,
    process_advantages,
    rloo_advantages,
)
from posttrain.ops.fused_head import head_logprobs
from posttrain.ops.importance import IS_MODES, rollout_metrics, rollout_weights
from posttrain.ops.kl import AdaptiveKLController, FixedKLController, kl_penalty
from posttrain.ops.logprobs import entropy_from_logits, sequence_logprobs, token_logprobs
from posttrain.ops.masked import masked_mean, masked_sum, masked_var, masked_whiten
from posttrain.ops.policy_loss import aggregate_loss, policy_loss
from posttrain.ops.ppo import last_token_index, ppo_advantages, token_rewards
from posttrain.ops.preference import bradley_terry_loss, dpo_loss, token_outcome_loss
from posttrain.ops.prm import (
    aggregate_step_scores,
    labels_to_classes,
    prm_step_loss,
    step_scores_from_logits,
)
from posttrain.ops.value_loss import explained_variance, value_loss

__all__ = [
    "IS_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "aggregate_step_scores",
    "bradley_terry_loss",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_advantages",
    "head_logprobs",
    "kl_penalty",
    "labels_to_classes",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "prm_step_loss",
    "process_advantages",
    "rloo_advantages",
    "rollout_metrics",
    "rollout_weights",
    "sequence_logprobs",
    "step_scores_from_logits",
    "token_logprobs",
    "token_outcome_loss",
    "value_loss",
    "last_token_index",
    "ppo_advantages",
    "token_rewards",
]
