"""What the prompt-sampling RL trainers (GRPO, PPO) share: the prompt draw, seeded sampling
through the sampler, scoring, and the reward metrics over every rank.

Randomness and torchrun (docs/distributed.md): prompts are drawn in the same global order on
every rank, each rank takes every `world`-th prompt with all its G samples, and sample j of the
step's i-th prompt draws from its own generator seeded by (seed, step, i, j), so rollouts do not
depend on the number of ranks or on where a run was resumed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch
from torch import Tensor

from posttrain.config import ConfigError, math_and_format
from posttrain.core.runtime import sequence_seed
from posttrain.engine.async_rollout import AsyncRollouts
from posttrain.engine.distributed import weighted
from posttrain.engine.session import build_rewards
from posttrain.engine.step_notes import StepNotes, completion_samples
from posttrain.engine.trainer import Trainer
from posttrain.engine.values import RewardValues, prompt_values
from posttrain.rewards.registry import ScoreResult
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.episodes import (
    AGENT_COUNTS,
    agent_keys,
    check_failing_tools,
    episode_metrics,
)
from posttrain.rollout.sampler import on_device
from posttrain.rollout.tools import AgentSpec


class PromptRLTrainer(Trainer):
    """Base of the trainers that sample `group_size` completions per prompt and score them."""

    _step: int = 0
    """The step being run (set by `step`): part of every sampling seed."""
    count_metrics = frozenset({"reward/unscorable", "reward/unscored", "reward/errors/",
                               "code/"}) | AGENT_COUNTS
    run_values = staticmethod(prompt_values)
    supports_tools = False
    """Whether the trainer runs multi-turn tool episodes (`tools`, `environment`)."""

    def __init__(self, cfg: Any = None, session: Any = None, *, tools: list[Any] | None = None,
                 environment_factory: Any = None, **kwargs: Any) -> None:
        """`tools=[f, ...]` and `environment_factory=Cls | {name: Cls}` as TRL takes them
        (docs/agents.md); the config records their import paths."""
        self._agent_objects = (tools, environment_factory)
        super().__init__(cfg, session, **kwargs, **agent_keys(tools, environment_factory))

    def validate(self) -> None:
        world = self.dist.world
        if getattr(self.cfg, "async_rollouts", False):
            self.rollouts_async = AsyncRollouts(self)
        if self.cfg.prompts_per_step % world:
            raise ConfigError(f"config key 'prompts_per_step'={self.cfg.prompts_per_step}: must "
                              f"be a multiple of the {world} torchrun processes")
        if self.cfg.agentic():
            self._validate_agent()
        audit = RewardValues(self.cfg.audit_rewards, self.cfg.reward_on_error,
                             self.cfg.reward_timeout_s, "audit_rewards")
        self.audit_fns = build_rewards(audit, None)[0]  # checked now
        if self.rollouts_async is not None:
            self.rollouts_async.spawn()  # its start (imports) overlaps the model's load

    def _validate_agent(self) -> None:
        """Refuse what multi-turn episodes do not cover, one line naming the key; build the
        tools and environment (imported now, before any model loads)."""
        cfg, key = self.cfg, "tools" if self.cfg.tools else "environment"
        refused = {key: not self.supports_tools and f"the {self.name} trainer",
                   "fsdp": cfg.fsdp and "FSDP2",
                   "advantage": getattr(cfg, "advantage", "") == "grpo_process" and
                   "advantage=grpo_process"}
        for name, why in refused.items():
            if why:
                raise ConfigError(f"config key {name!r}: multi-turn tool rollouts (tools / "
                                  f"environment) are not implemented for {why}; docs/agents.md")
        tools, factory = getattr(self, "_agent_objects", (None, None))
        tool_objs = [t for t in tools or [] if not isinstance(t, str)] or None
        try:
            self.agent = AgentSpec.build(cfg, tool_objs, factory)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        names = [r.get("name") for r in cfg.rewards]
        if any(hasattr(c, "get_reward") for c in self.agent.classes()) and \
                "environment" not in names:  # the defaults only when nothing else scores
            given = [] if cfg.rewards == math_and_format() else cfg.rewards
            cfg.rewards = [*given, {"name": "environment", "weight": 1.0}]
        if not cfg.rewards:
            raise ConfigError("config key 'rewards': empty, and the environment has no "
                              "get_reward(): nothing would score the episodes")

    def agent_metrics(self, rollout: Rollout) -> dict[str, float]:
        """`agent/*` of this rank's episodes (counts and weighted means); stops the run when a
        tool failed (raised or timed out) on most of its calls of the step, over every rank."""
        counts, means = episode_metrics(rollout.episodes)
        self.notes.tool_answers(self._step, [e["tool_overflow"] for e in rollout.episodes],
                                self.cfg.max_new_tokens)
        out = dict(counts)
        for key, (value, weight) in means.items():
            out.update(weighted({key: value}, weight))
        check_failing_tools(self.dist.all_gather_objects(
            [e.get("by_tool", {}) for e in rollout.episodes]))
        return out

    @functools.cached_property
    def sampling(self) -> SamplingParams:
        cfg = self.cfg
        return SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)

    @functools.cached_property
    def notes(self) -> StepNotes:
        """Console warnings about a step's rewards and truncation; `log_completions`."""
        return StepNotes(self.name, self.dist.is_main)

    def watch(self, step: int, metrics: dict[str, float]) -> None:
        self.notes.trend(step, metrics)
        self.notes.tripwire(step, metrics)

    def audit(self, rollout: Rollout, result: ScoreResult) -> dict[str, float]:
        """`audit_rewards` on `audit_samples` of this rank's completions (evenly spread):
        `reward/audit_mean`, `reward/audit_train_mean` (the training reward on the same
        samples) and `reward/audit_gap` (training minus audit); their errors are recorded."""
        n = len(rollout.completions)
        idx = sorted({i * n // min(n, self.cfg.audit_samples) for i in
                      range(min(n, self.cfg.audit_samples))})
        got = self.audit_fns.score([rollout.completions[i] for i in idx],
                                      [rollout.rows[i] for i in idx])
        self.session.log_reward_errors([{**e, "audit": True} for e in got.errors])
        pairs = [(result.scores[i], a) for i, a in zip(idx, got.scores, strict=True)
                 if a == a and result.scores[i] == result.scores[i]]  # NaN: unscorable
        if not pairs:
            return {}
        train, audit = (sum(p[k] for p in pairs) / len(pairs) for k in (0, 1))
        return {"reward/audit_mean": audit, "reward/audit_train_mean": train,
                "reward/audit_gap": train - audit}

    @functools.cached_property
    def accuracy_from(self) -> str | None:
        """The reward whose verdicts are `reward/accuracy` (the first `math`/`code` one)."""
        return first_verifier(self.session.reward_names)

    def sample_prompts(self, n_prompts: int,
                       first: int = 0) -> tuple[Rollout, Any, dict[str, float]]:
        """Draw `n_prompts` prompts (every rank alike; `first`: how many this step drew
        before), sample this rank's share and score it.

        Returns the rollout (`scores` [n] set, NaN where unscorable), the rewards' result
        (`per_function`, `metrics`) and the seconds spent ({"gen", "score"})."""
        cfg, G = self.cfg, self.cfg.group_size
        if self.rollouts_async is not None:
            rollout, result, seconds = self.rollouts_async.take(self._step)
        else:
            drawn = self.next_rows(n_prompts)
            mine = self.dist.shard(list(range(n_prompts)))
            rows = [drawn[i] for i in mine]
            seeds = [sequence_seed(cfg.seed, self._step, first + i, j)
                     for i in mine for j in range(G)]
            t0 = time.time()
            sampler = self.sync_sampler()  # hf under autocast_bf16: a synced bf16 copy
            prompts = [] if getattr(sampler, "renders_rows", False) else [
                self.session.render(r["prompt"]) for r in rows]  # episodes render their own
            with self.gathered() if sampler.runs_policy else contextlib.nullcontext():
                rollout = sampler.generate(prompts, group_size=G, rows=rows,
                                          params=self.sampling, seeds=seeds,
                                          batch_size=cfg.generation_batch_size)
            t1 = time.time()
            result = self.session.rewards.score(rollout.completions, rollout.rows)
            seconds = {"gen": t1 - t0, "score": time.time() - t1}
        rollout = on_device(rollout, self.device, cfg.rollout_engine)  # vLLM's: on the CPU
        rollout.scores = torch.tensor(result.scores, dtype=torch.float32)  # [n]
        self.session.log_reward_errors(result.errors)
        self.notes.rewards(self._step, result.errors, len(result.scores))
        self.notes.truncation(self._step, float(rollout.truncated.float().mean()),
                              cfg.max_new_tokens)
        if cfg.audit_rewards and first == 0 and self._step % cfg.audit_every == 0 and \
                rollout.completions:  # the tripwire's sample
            result.metrics.update(self.audit(rollout, result))
        if first == 0 and cfg.log_completions:  # True: one group
            n = G if cfg.log_completions is True else int(cfg.log_completions)
            self.notes.completions(cfg.out_dir, self._step, completion_samples(rollout, result, n))
        return rollout, result, seconds

    rollouts_async: AsyncRollouts | None = None
    """`async_rollouts`: the sampler process and its schedule (posttrain.engine.async_rollout)."""

    def evaluate(self, when: str) -> dict[str, Any]:
        if when != "before" or self.rollouts_async is None:
            return super().evaluate(when)
        base = super().evaluate
        return self.rollouts_async.around_first_eval(lambda: base(when))  # sampling meanwhile

    def close_sampler(self) -> None:
        if self.rollouts_async is not None:
            self.rollouts_async.close()
        super().close_sampler()

    def reward_metrics(self, scores: Tensor, rollout: Rollout,
                       verdicts: list[float] | None) -> tuple[Tensor, dict[str, float]]:
        """Every rank's `scores` gathered ([N], rank-major) and the step's reward metrics over
        them: mean and std of the scorable ones, `reward/accuracy` from this rank's `verdicts`
        (of `accuracy_from`) gathered too, and the response lengths of this rank's `rollout`."""
        every = torch.tensor(sum(self.dist.all_gather_objects(scores.tolist()), []))  # [N]
        ok = ~every.isnan()
        metrics = {
            "reward/mean": float(every[ok].mean()) if bool(ok.any()) else float("nan"),
            "reward/std": float(every[ok].std()) if int(ok.sum()) > 1 else 0.0,
            "response/length_mean": float(rollout.response_mask.sum(1).float().mean()),
            "response/truncated_frac": float(rollout.truncated.float().mean()),
        }
        if verdicts is not None:
            verdicts = sum(self.dist.all_gather_objects(verdicts), [])
        metrics.update(accuracy_metrics(every.tolist(), verdicts))
        return every, metrics


VERIFIERS = ("math", "code")
"""Reward functions whose score >= 1.0 means "correct" (the verifiable rewards)."""


def first_verifier(names: list[str]) -> str | None:
    """The first verifiable reward (`math` / `code`) of `rewards:`, at any weight, or None."""
    return next((n for n in names if n in VERIFIERS), None)


def accuracy_metrics(scores: list[float], verdicts: list[float] | None) -> dict[str, float]:
    """`reward/frac_score_ge_1`: the fraction of scorable samples whose weighted score is
    >= 1.0 (whatever the rewards are); `reward/accuracy`: the fraction of the verifier's
    scorable verdicts that are >= 1.0, only when `verdicts` (the verifier's scores) is given."""
    valid = [s for s in scores if s == s]  # NaN: unscorable
    out = {"reward/frac_score_ge_1":
           sum(s >= 1.0 for s in valid) / len(valid) if valid else float("nan")}
    if verdicts is not None:
        ok = [v for v in verdicts if v == v]
        out["reward/accuracy"] = sum(v >= 1.0 for v in ok) / len(ok) if ok else float("nan")
    return out


def all_rejected_warning(name: str, step: int, cfg: Any, consequence: str) -> str:
    """The one line a trainer prints when its rollout correction rejected every sample."""
    return (f"[{name}] warning: step {step}: rollout_is={cfg.rollout_correction()} rejected "
            f"every sample (importance ratio above rollout_is_cap={cfg.rollout_is_cap}, see "
            f"rollout/*): {consequence}")
