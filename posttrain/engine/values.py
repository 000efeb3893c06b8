"""The config values engine/ reads beyond `BaseConfig`'s keys, as small typed records.

A trainer builds them from its own config (its `run_values`, one of the builders below) and
the engine takes them (`load_session(values=...)`, `Session.values`), so the keys engine/ reads
are in its signatures, never probed with `getattr(cfg, key, default)` (tests/engine/test_values.py
counts such probes: 0). A record's defaults are what a trainer whose config lacks those keys
runs with (no sampling, no reward functions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.config.preference import PairsConfig
from posttrain.config.rl import PromptRLConfig
from posttrain.config.rm import PRMConfig, RMConfig
from posttrain.config.sft import SFTConfig


@dataclass(frozen=True)
class RowValues:
    """How rows are read: the prompt's field, the answer's (exposed to rewards as `answer`,
    after `answer_marker` when set)."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    answer_marker: str = ""


@dataclass(frozen=True)
class RewardValues:
    """Reward functions (the entries of config key `key`; none: no held-out scoring) and what
    a crash or a hang of one scores (`reward_on_error`, `reward_timeout_s`)."""

    specs: list[dict[str, Any]] = field(default_factory=list)
    on_error: str = "auto"
    timeout_s: float = 60.0
    key: str = "rewards"


@dataclass(frozen=True)
class GenerationValues:
    """Token budgets and the sampling temperature. `max_new_tokens`: the sampling budget (None:
    nothing is sampled, no prompt is checked against a budget); `max_prompt_len`: 0 for none;
    `eval_max_new_tokens`: greedy evaluation's budget (config key `eval_max_new_tokens` in
    every trainer); `temperature`: the sampling's, which the policy forward divides logits by."""

    max_new_tokens: int | None = None
    max_prompt_len: int = 0
    eval_max_new_tokens: int = 64
    temperature: float = 1.0


@dataclass(frozen=True)
class RunValues:
    """Everything above, plus the tool-rendering keys and the largest forward a learner runs:
    `micro_batch_size` sequences of up to `max_len` tokens (None: not known)."""

    rows: RowValues = field(default_factory=RowValues)
    rewards: RewardValues = field(default_factory=RewardValues)
    generation: GenerationValues = field(default_factory=GenerationValues)
    tool_schemas: str = "template"
    tool_call_parser: str = "auto"
    micro_batch_size: int = 1
    max_len: int | None = None


def prompt_values(cfg: PromptRLConfig) -> RunValues:
    """The values of a prompt-RL config (GRPO, PPO, online DPO, `posttrain eval`)."""
    return RunValues(RowValues(cfg.prompt_field, cfg.answer_field, cfg.answer_marker),
                     RewardValues(cfg.rewards, cfg.reward_on_error, cfg.reward_timeout_s),
                     GenerationValues(cfg.max_new_tokens, cfg.max_prompt_len,
                                      cfg.eval_max_new_tokens, cfg.temperature),
                     cfg.tool_schemas, cfg.tool_call_parser, cfg.micro_batch_size,
                     cfg.max_new_tokens)


def completion_values(cfg: SFTConfig | PairsConfig) -> RunValues:
    """The values of a config whose rows carry completions (SFT, DPO, KTO): greedy held-out
    evaluation with `eval_max_new_tokens`, scored by `eval_rewards`."""
    return RunValues(rewards=RewardValues(cfg.eval_rewards, key="eval_rewards"),
                     generation=GenerationValues(cfg.eval_max_new_tokens,
                                                 eval_max_new_tokens=cfg.eval_max_new_tokens),
                     micro_batch_size=cfg.micro_batch_size, max_len=cfg.max_seq_len)


def reward_model_values(cfg: RMConfig | PRMConfig) -> RunValues:
    """The values of a reward or step-label model's config: only its largest forward."""
    return RunValues(micro_batch_size=cfg.micro_batch_size, max_len=cfg.max_seq_len)
