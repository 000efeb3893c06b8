"""Fields every RL trainer on a prompt dataset shares (GRPO, PPO): data, rewards, sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from posttrain.config.base import BaseConfig, check_generation_budget, check_table, math_and_format
from posttrain.config.keys import EvalKeys, GenerationBatchKeys, MicroBatchKeys, PromptKeys


@dataclass
class PromptRLConfig(PromptKeys, EvalKeys, GenerationBatchKeys, MicroBatchKeys, BaseConfig):
    # --- data and rewards (prompt_field, answer_field, answer_marker: PromptKeys) ---
    rewards: list[dict[str, Any]] = field(default_factory=math_and_format)
    """Reward functions and weights: [{name: math|format|code|pkg.module:function, weight: w}]
    (a trained model too: a `reward_model` entry); the weighted sum scores a whole completion
    (PPO puts it on the last completion token as R)."""
    reward_on_error: Literal["auto", "zero", "raise"] = "auto"
    """A reward function that raises on a sample. auto: that sample scores 0 (counted in
    reward/errors/<name>, recorded with the sample in out_dir/reward_errors.jsonl), but a
    function that fails on more than half of a step's samples stops the run with its first
    error and sample; zero: always score 0 and go on (a reward that always fails then trains on
    nothing); raise: stop at the first failure (docs/rewards.md)."""
    reward_timeout_s: float = 60.0
    """Wall-clock limit of each awaited reward call (an `async def` reward function or
    environment `get_reward`, awaited together within a step); past it the call is cancelled
    and its samples are reward errors (reward_on_error). A synchronous function cannot be
    stopped and is not bounded by it; the remote and judge rewards have their own
    `timeout_s`."""
    audit_rewards: list[dict[str, Any]] = field(default_factory=list)
    """A second reward list, never trained on (a held-out verifier, a judge): scored on
    audit_samples completions of every audit_every-th step, logged as reward/audit_mean,
    reward/audit_train_mean (the training reward on the same samples) and reward/audit_gap
    (their difference); one warning line when the training reward rises while this one falls
    (docs/rewards.md, "Tripwires")."""
    audit_every: int = 1
    """Score audit_rewards every this many steps."""
    audit_samples: int = 8
    """Completions per audited step and rank (evenly spread over the step's)."""
    log_completions: int | bool = 0
    """Write this many sampled training completions of each step (at most the step's), with
    their prompt, weighted reward and each reward function's value, to out_dir/completions.jsonl
    and the console (true: one group of group_size; TRL's num_completions_to_print); 0 or
    false: none (held-out samples are in eval_*.jsonl); a negative count is refused."""
    # --- sampling (max_new_tokens, temperature, top_p: PromptKeys) ---
    group_size: int = 8
    """G: completions sampled per prompt (>= 2)."""
    prompts_per_step: int = 8
    """B: prompts per rollout batch; N = B*G sequences per step (online DPO: at most B pairs
    train per step; a group of ties gives none)."""
    max_prompt_len: int = 0
    """Longest prompt in tokens after rendering; a longer one is an error naming its row (never
    cut). 0: only the model's context limits it (prompt + max_new_tokens must fit it, checked
    when the tokenizer loads, before the model's weights)."""
    top_k: int = 0
    """Top-k sampling; 0 disables."""
    # --- agents: multi-turn rollouts with tools (docs/agents.md) ---
    tools: list[str] = field(default_factory=list)
    """Tool functions `pkg.module:function` (typed, Google-style docstrings; TRL's `tools`) the
    model may call during a rollout; `python` is the built-in sandboxed Python tool. GRPO and
    PPO, on every sampler (docs/agents.md)."""
    environment: str | dict[str, str] = ""
    """`pkg.module:Class` (TRL's `environment_factory`), or {name: pkg.module:Class} picked by
    each row's `environment` field: one instance per rollout, `reset(**row)` before it, its
    public methods are tools, its `get_reward()` (if any) a reward named `environment`."""
    max_tool_calling_iterations: int = 4
    """Most tool-calling rounds per episode (TRL's name); a call on the last turn ends the
    episode (counted in agent/cut_by_turns). The whole episode, model and tool tokens, fits
    in max_new_tokens."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call; past it the call's answer is a timeout message, the
    episode's later calls of the turn are not run, and an environment it ran on is closed."""
    max_tool_calls_per_turn: int = 8
    """Most tool calls one model turn runs (TRL has no such bound); the others are answered
    with an error message (agent/tool_errors/too_many)."""
    tool_turn_timeout_s: float = 30.0
    """Wall-clock limit of one turn's tool calls of an episode; calls not done by then answer
    with a timeout message."""
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "openai", "deepseek_v3",
                              "response_template"] = "auto"
    """How a turn's tool calls are read (vLLM's parser names): `auto` reads the format off the
    tokenizer (its response template, else the markers its chat template writes; a template
    that renders tools in another format is refused before the model loads); hermes
    `<tool_call>{json}</tool_call>` (Qwen3; the fallback where the template renders no tools),
    llama3_json (Llama 3.x), openai (gpt-oss harmony), deepseek_v3, response_template (the
    tokenizer's `parse_response`). docs/agents.md, "Model families"."""
    tool_schemas: Literal["template", "none"] = "template"
    """How the model learns its tools: `template`, their JSON schemas rendered by the
    tokenizer's chat template (`tools=`); a template that renders none is refused before the
    model loads (as TRL refuses it). `none`: no schemas in the prompt, for a model that knows
    its tools already (e.g. from SFT, as the demo's tool world)."""
    sandbox_mode: Literal["bwrap", "limits"] = "bwrap"
    """Containment of the `python` tool: bwrap (bubblewrap; the run is refused where it does
    not work) or limits (resource limits only: no file-system or network isolation)."""
    # --- rollout correction (posttrain/ops/importance.py, docs/algorithms.md) ---
    rollout_is: Literal["auto", "none", "token_truncate", "token_mask", "sequence_truncate",
                        "sequence_mask"] = "auto"
    """Importance correction of the sampler/learner log-prob gap: token_* weight each token by
    its ratio pi_old/q (truncate: capped at rollout_is_cap; mask: tokens above the cap leave the
    loss), sequence_* the same with the sequence's ratio. auto: none with the hf sampler (its gap
    is still logged as rollout/*), sequence_mask (TRL's default) with a vLLM sampler. Any mode
    but none costs one no-grad learner forward per step for pi_old."""
    rollout_is_cap: float = 3.0
    """The ratio above which rollout_is truncates (min(r, cap)) or rejects."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (gradient accumulation within a mini-batch; the update is
    the same for any value). 8 fits a 0.5B-1.5B model with 1k-token completions on one GPU (as
    TRL's per-device batch of 8 and verl's per-GPU micro-batch); on a CPU with a tiny model 64
    is faster."""
    # --- policy loss and KL (both trainers; their other loss and KL keys are their own) ---
    clip_eps_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip range: ratio <= 1 + clip_eps_high (DAPO clip-higher: > clip_eps_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c (e.g. 3.0) for negative advantages; null disables."""
    kl_clamp: float = 10.0
    """Bound on the per-token KL estimate: beyond +-kl_clamp its value is the bound and its
    gradient 0 (OpenRLHF for k1/k2/k3, verl for k3), so one token far from the reference cannot
    dominate; 0 turns it off (docs/algorithms.md)."""

    def agentic(self) -> bool:
        """Whether rollouts are multi-turn episodes with tools (`tools` or `environment`)."""
        return bool(self.tools or self.environment)

    def rollout_correction(self) -> str:
        """The `rollout_is` mode this run uses (`auto` resolved by the sampler)."""
        if self.rollout_is != "auto":
            return self.rollout_is
        return "none" if self.rollout_engine == "hf" else "sequence_mask"

    def validate(self) -> None:
        super().validate()
        check_generation_budget(self, "max_new_tokens", "eval_max_new_tokens")
        check_table(self, {
            "temperature": (self.temperature > 0, "expected > 0 (sampling is required)"),
            "rewards": (bool(self.rewards or self.environment), "at least one reward function "
                        "is required (or an environment's get_reward)"),
            "log_completions": (self.log_completions is True or self.log_completions >= 0,
                                "expected true (one group), false / 0 (none) or a count of "
                                "samples per step (TRL's num_completions_to_print)"),
            "reward_timeout_s": (self.reward_timeout_s > 0, "expected > 0 seconds"),
            "audit_every": (self.audit_every >= 1, "expected >= 1 (steps)"),
            "audit_samples": (self.audit_samples >= 1, "expected >= 1 (completions)"),
            "kl_clamp": (self.kl_clamp >= 0, "expected >= 0 (0: off)"),
            "rollout_is_cap": (self.rollout_is_cap > 0, "expected > 0"),
            "max_tool_calling_iterations": (self.max_tool_calling_iterations >= 0,
                                            "expected >= 0"),
            "tool_timeout_s": (self.tool_timeout_s > 0, "expected > 0"),
            "max_tool_calls_per_turn": (self.max_tool_calls_per_turn >= 1, "expected >= 1"),
            "tool_turn_timeout_s": (self.tool_turn_timeout_s > 0, "expected > 0"),
            "max_prompt_len": (self.max_prompt_len >= 0, "expected >= 0 (0: only the model's "
                               "context)")})

