"""Rollout: sample completions and keep what the learner needs (the `Rollout` record)."""

from posttrain.rollout.hf import (
    SamplingParams,
    device_generator,
    generate,
    stop_token_ids,
    tokenize_prompts,
)
from posttrain.rollout.record import Rollout, concat_rollouts

__all__ = [
    "Rollout",
    "SamplingParams",
    "concat_rollouts",
    "device_generator",
    "generate",
    "stop_token_ids",
    "tokenize_prompts",
]
