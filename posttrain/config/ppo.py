"""PPO config: actor, critic, frozen reference and rewards (RLHF as in Ziegler et al. 2019 and
InstructGPT, Ouyang et al. 2022); defaults follow those papers' open implementations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from posttrain.config.base import check_table
from posttrain.config.keys import PolicyGradientKeys
from posttrain.config.rl import PromptRLConfig


@dataclass
class PPOConfig(PolicyGradientKeys, PromptRLConfig):
    # --- rollout ---
    prompts_per_step: int = 64
    """Prompts per rollout batch."""
    group_size: int = 1
    """Completions sampled per prompt (PPO needs no group: 1 is the classic setting)."""
    # --- critic ---
    critic_model: str = ""
    """Where the critic's body comes from: empty = a copy of the policy (the seed note's
    choice); a reward-model directory (a 1-label sequence classifier: its score layer becomes
    the value head); a critic saved by PPO; or any other causal LM (a separate critic). With
    LoRA (lora_r > 0) it must stay empty: the critic is a second adapter on the policy's base."""
    critic_lr: float = 1e-4
    """Critic learning rate (its own AdamW and schedule)."""
    vf_coef: float = 0.1
    """c_v: weight of the value loss (L = L_policy + c_v L_V - c_e H)."""
    value_clip: float | None = 0.2
    """eps_v of the clipped value loss around the rollout-time values; null: plain MSE."""
    critic_warmup_steps: int = 0
    """First steps that train only the critic (the policy stays at its SFT start)."""
    # --- reward shaping and KL ---
    kl_coef: float = 0.05
    """beta: per-token reward -beta * KL(policy || reference). 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimator in the reward (k1 = log ratio, the classic RLHF penalty)."""
    adaptive_kl: bool = False
    """Adapt beta toward kl_target (Ziegler et al. 2019, section 2.2); false: beta fixed."""
    kl_target: float = 6.0
    """Target per-sequence KL (nats) of the adaptive controller."""
    kl_horizon: float = 10000.0
    """Horizon (in samples) of the adaptive controller."""
    # --- advantages ---
    gamma: float = 1.0
    """Discount of GAE."""
    gae_lambda: float = 0.95
    """GAE lambda (1 = Monte Carlo returns, 0 = one-step TD)."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean, unit variance over the batch's real tokens."""
    # --- policy loss ---
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean")
    """Aggregation of the policy loss (PPO averages over all tokens of a mini-batch)."""
    ent_coef: float = 0.0
    """c_e: entropy bonus weight."""
    # --- update ---
    ppo_epochs: int = 4
    """Passes over each rollout batch."""
    mini_batches: int = 4
    """Optimizer steps per pass (the batch is split into this many shuffled mini-batches)."""
    target_kl: float | None = None
    """Stop this step's remaining PPO epochs when the approx KL between the rollout policy and
    the current one, mean(logp_old - logp), exceeds this (the mini-batch that crossed it is not
    applied); null: never stop early."""

    def validate(self) -> None:
        super().validate()
        n = self.prompts_per_step * self.group_size
        check_table(self, {**{k: (getattr(self, k) >= 1, "expected >= 1") for k in (
            "prompts_per_step", "group_size", "ppo_epochs", "micro_batch_size", "mini_batches")},
            "mini_batches": (1 <= self.mini_batches <= n, f"expected 1 to the {n} sequences of "
                             "a step (prompts_per_step*group_size)"),
            "kl_coef": (self.kl_coef >= 0, "expected >= 0"),
            "adaptive_kl": (not self.adaptive_kl or min(self.kl_coef, self.kl_target,
                                                         self.kl_horizon) > 0,
                            "needs kl_coef > 0 (the starting beta), kl_target > 0 and "
                            "kl_horizon > 0"),
            "gamma": (0 <= self.gamma <= 1, "expected in [0, 1]"),
            "gae_lambda": (0 <= self.gae_lambda <= 1, "expected in [0, 1]"),
            "target_kl": (self.target_kl is None or self.target_kl > 0, "expected > 0 or null"),
            "critic_lr": (self.critic_lr > 0, "expected > 0"),
            "critic_model": (not (self.lora_r > 0 and self.critic_model), "must be empty with "
                             "LoRA (lora_r > 0); the critic is then a second adapter on the "
                             "policy's frozen base")})
