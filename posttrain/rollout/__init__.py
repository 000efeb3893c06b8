"""Rollout: sample completions and keep what the learner needs (the `Rollout` record)."""

from posttrain.rollout.hf import SamplingParams, autocast_ctx, generate, tokenize_prompts
from posttrain.rollout.record import Rollout, concat_rollouts

__all__ = [
    "Rollout",
    "SamplingParams",
    "autocast_ctx",
    "concat_rollouts",
    "generate",
    "tokenize_prompts",
]
