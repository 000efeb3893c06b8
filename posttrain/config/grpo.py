"""GRPO config: the axes of the GRPO family (GSPO, DAPO, Dr. GRPO and RLOO are presets)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from posttrain.config.base import check_table
from posttrain.config.keys import PolicyGradientKeys
from posttrain.config.rl import PromptRLConfig


@dataclass
class GRPOConfig(PolicyGradientKeys, PromptRLConfig):
    # --- advantages ---
    advantage: Literal["grpo", "rloo", "grpo_process"] = "grpo"
    """Advantage estimator: group-normalised (GRPO), leave-one-out (RLOO), or GRPO with process
    supervision (per-step scores from `process_reward_model`, DeepSeekMath section 4.1.3):
    advantage = outcome advantage of `rewards` + process_weight * process advantage."""
    process_reward_model: str = ""
    """grpo_process: a PRM directory saved by `posttrain prm` (steps are cut with its own rule),
    or 'package.module:name' of a step scorer (docs/process_supervision.md)."""
    process_weight: float = 1.0
    """grpo_process: w in `A = A_outcome + w * A_process`. `rewards` with weight 0 everywhere
    gives process-only GRPO; the verifier stays listed so its accuracy is still logged."""
    scale: Literal["group", "batch", "none"] = "group"
    """GRPO std scaling: per group, whole batch, or none (Dr. GRPO)."""
    std_ddof: int = 0
    """0: population std as in the GRPO paper; 1: sample std as TRL/verl."""
    # --- policy loss ---
    ratio_level: Literal["token", "sequence", "sequence_token"] = "token"
    """Importance ratio per token (PPO/GRPO), per sequence (GSPO) or GSPO-token."""
    sequence_ratio: Literal["geometric", "product"] = "geometric"
    """GSPO sequence ratio: length-normalised (paper) or the plain product (seed note form)."""
    # --- KL to the reference model (loss_agg, kl_coef, kl_estimator: PolicyGradientKeys) ---
    kl_placement: Literal["loss", "reward"] = "loss"
    """KL added to the loss (GRPO) or subtracted from each sequence's score before advantages."""
    # --- update (mini_batches: PolicyGradientKeys) ---
    num_iterations: int = 1
    """Passes over each rollout batch (GRPO's mu)."""
    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    """Off-policy updates: reuse the sampler's log-probs or run one more forward pass. Under
    autocast_bf16 the sampler's log-probs come from a bf16 decode, so `recompute` is used (a
    ratio must start at exactly 1 for tight clip ranges such as GSPO's); with a rollout
    correction (`rollout_is`) or multi-turn tool episodes pi_old is always the learner's
    forward."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_new_tokens from the loss (DAPO)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (DAPO) and refill with new prompts."""
    dynamic_sampling_max_rounds: int = 3
    """Extra generation rounds to refill dropped groups; after that train on what is left."""
    # --- asynchronous rollouts (docs/async.md) ---
    async_rollouts: bool = False
    """Sample and score the coming steps' groups in a sampler process while the learner trains
    (the `hf` sampler, or a `vllm_server` it pushes each version to; a CPU learner, one process;
    multi-turn episodes too)."""
    max_staleness: int = 1
    """async_rollouts: learner steps a sample may lag the weights it trains (one step: one
    push, num_iterations x mini_batches optimizer steps); 0 is the synchronous run. Above 0,
    `rollout_is: auto` is token_truncate: each token's loss weighted by min(pi_old / q, cap)."""
    sampler_threads: int = 1
    """async_rollouts: torch threads of the sampler process (the learner keeps `threads`)."""
    lr: float = 3e-5

    def rollout_correction(self) -> str:
        if self.async_rollouts and self.max_staleness > 0 and self.rollout_is == "auto":
            return "token_truncate"  # decoupled PPO's behaviour weight (docs/async.md)
        return super().rollout_correction()

    def key_needs(self) -> dict[str, tuple[bool, str]]:
        return {**super().key_needs(), **{k: (self.async_rollouts, "async_rollouts: true")
                                          for k in ("max_staleness", "sampler_threads")}}

    def validate(self) -> None:
        super().validate()
        n = self.group_size * self.prompts_per_step
        process = self.advantage == "grpo_process"
        check_table(self, {
            "group_size": (self.group_size >= 2, "GRPO needs at least 2 samples per prompt to "
                           "form a group baseline"),
            "prompts_per_step": (self.prompts_per_step >= 1, "expected >= 1"),
            "mini_batches": (self.mini_batches >= 1 and n % self.mini_batches == 0, f"must "
                             f"divide the {n} sequences of a step (prompts_per_step*group_size)"),
            "micro_batch_size": (self.micro_batch_size >= 1, "expected >= 1"),
            "process_reward_model": (process == bool(self.process_reward_model), "required "
                                     "with advantage=grpo_process (a directory saved by "
                                     "`posttrain prm`) and only used by advantage=grpo_process "
                                     "(to train on an aggregated PRM score, list {name: "
                                     "process_reward_model, path: ...} in rewards)"),
            "process_weight": (math.isfinite(self.process_weight) and self.process_weight >= 0,
                               "expected a finite number >= 0"),
            "max_staleness": (self.max_staleness >= 0, "expected >= 0"),
            "sampler_threads": (self.sampler_threads >= 1, "expected >= 1")})
        if self.async_rollouts:  # what the sampler process does not cover yet
            check_table(self, {k: (not bad, f"not implemented with async_rollouts ({why}); "
                                   "docs/async.md") for k, (bad, why) in {
                "rollout_engine": (self.rollout_engine == "vllm_colocate", "the sampler "
                                   "process runs hf or talks to a vllm_server"),
                "eval_every": (self.rollout_engine == "vllm_server" and self.eval_every > 0,
                               "a mid-run evaluation would push the learner's weights to the "
                               "server the sampler process samples from"),
                "dynamic_sampling": (self.dynamic_sampling, "refills need a round trip"),
                "fsdp": (self.fsdp, "one process")}.items()})
