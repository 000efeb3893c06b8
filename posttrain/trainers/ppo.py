"""PPO for RLHF: actor, critic, frozen reference and reward functions / a reward model.

One step (numbered as in the code): 1 generate completions (the shared rollout) -> 2 score each
(verifiable rewards and/or a reward model, weighted sum R) -> 3 no-grad old log-probs, reference
log-probs, values; per-token rewards ``-beta * KL[t]`` plus R on the last real token -> 4 GAE
advantages and returns (V = 0 after the last token), optionally whitened -> 5 ``ppo_epochs`` x
``mini_batches`` steps of the clipped policy and value losses, entropy bonus, clipping, critic
warm-up, early stop on approx KL > ``target_kl`` (stops policy and critic for the step).
Deliberate choices (docs/ppo.md): policy and critic share no trainable weights (own AdamW, LR,
clipping); old log-probs recomputed by the training forward (first ratio 1); an unscorable
completion is dropped and counted (`reward/unscorable`); multi-turn episodes read the whole
episode but count only the model's tokens (`response_mask`; GAE skips tool tokens).
Notation: N sequences in the step, T completion tokens.
More (papers): docs/ppo.md, "Module notes", posttrain.trainers.ppo.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import Tensor

from posttrain.config.ppo import PPOConfig
from posttrain.core.runtime import sequence_seed
from posttrain.engine.distributed import weighted
from posttrain.engine.update import OptimGroup, local_plan, row_widths
from posttrain.models.value_head import (
    CRITIC_ADAPTER,
    ValueModel,
    critic_from_policy,
    load_critic,
    shared_lora_critic,
)
from posttrain.ops import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    explained_variance,
    kl_penalty,
    masked_mean,
    policy_loss,
    ppo_advantages,
    rollout_metrics,
    rollout_weights,
    token_rewards,
    value_loss,
)
from posttrain.ops.masked import keep
from posttrain.rollout import Rollout
from posttrain.trainers.prompt_rl import PromptRLTrainer, all_rejected_warning


class PPOTrainer(PromptRLTrainer):
    """PPO with a learned critic on a prompt dataset with reward functions / a reward model."""

    name = "ppo"
    config_class = PPOConfig
    data_kind = "prompts"
    progress_keys = ("reward/mean", "reward/accuracy", "response/truncated_frac",
                     "kl/coef")
    supports_fsdp = False  # the critic is not sharded; data parallel works
    supports_token_budget = supports_packing = True  # packing: the critic's forward too
    supports_tools = True  # episodes: tool tokens are read, never actions (docs/ppo.md)
    cfg: PPOConfig

    def setup(self) -> None:
        cfg = self.cfg
        if cfg.kl_coef > 0:
            self.load_reference()  # none with LoRA: the adapters-off base is the reference
        self.critic = self.build_critic().to(self.device)
        self.kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
                       if cfg.adaptive_kl else FixedKLController(cfg.kl_coef))
        self.early_stops = 0
        self.kept: list[int] = []  # this step: the rows of this rank's rollout kept
        self.n_sampled = 0  # ... of its sampled rows

    def build_critic(self) -> ValueModel:
        """The critic (see posttrain.models.value_head): shared-base LoRA adapter, a model from
        `critic_model`, or a copy of the policy's body."""
        cfg = self.cfg
        if cfg.lora_r > 0:
            return shared_lora_critic(self.model, cfg.lora_r, cfg.lora_alpha,
                                      cfg.lora_target_modules)
        if cfg.critic_model:
            return load_critic(cfg.critic_model)
        return critic_from_policy(self.model)

    @property
    def sum_over_ranks(self) -> Any:
        """The all-reduce sum under torchrun (every rank's tokens), None on one process."""
        return self.dist.sum if self.dist.enabled else None

    def optimizer_groups(self) -> list[OptimGroup]:
        """The policy (without the critic adapter of a shared-base LoRA critic) and the critic,
        each with its own AdamW, schedule and clipping."""
        policy = [p for n, p in self.model.named_parameters()
                  if p.requires_grad and f".{CRITIC_ADAPTER}." not in f".{n}."]
        return [self.make_group("policy", policy),
                self.make_group("critic", self.critic.trainable_parameters(),
                                lr=self.cfg.critic_lr)]

    def state_modules(self) -> dict[str, torch.nn.Module]:
        """The critic's weights (with the LoRA critic only its head: its adapter is part of
        the policy's trainable parameters)."""
        return {"critic_head": self.critic.head} if self.cfg.lora_r > 0 else {
            "critic": self.critic}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kl_coef": self.kl_ctl.value,
                "early_stops": self.early_stops}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.kl_ctl.value = float(state["kl_coef"])
        self.early_stops = int(state["early_stops"])

    def optimizer_steps(self) -> int:
        return self.cfg.max_steps * self.cfg.ppo_epochs * self.cfg.mini_batches

    # ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        t0 = time.time()
        self._step = step
        rollout, scores, metrics = self.rollout_and_score()  # 1 generate, 2 score
        t1 = time.time()
        batch = self.prepare(rollout, scores, metrics)  # 3 old log-probs, ref, values; 4 GAE
        t2 = time.time()
        train_policy = step > self.cfg.critic_warmup_steps
        metrics.update(self.ppo_update(batch, train_policy))  # 5 epochs x mini-batches
        n_tok = float(self.dist.sum(float(batch.response_mask.sum())))
        metrics.update({"perf/rollout_seconds": t1 - t0, "perf/prepare_seconds": t2 - t1,
                        "perf/train_seconds": time.time() - t2,
                        "perf/train_tokens_per_sec": n_tok / max(time.time() - t2, 1e-9)})
        return metrics

    def rollout_and_score(self) -> tuple[Any, Tensor, dict[str, float]]:
        """1 + 2: sample `group_size` completions per prompt and score them; drop unscorable.

        Returns the rollout, its scores [n] and the reward metrics (over every rank's samples);
        `self.kept` holds the kept rows' indices in this rank's rollout."""
        rollout, result, _ = self.sample_prompts(self.cfg.prompts_per_step)
        scores = rollout.scores  # [n]
        verdicts = (result.per_function[self.accuracy_from]
                    if self.accuracy_from is not None else None)
        every, reward = self.reward_metrics(scores, rollout, verdicts)
        metrics = {**result.metrics, **reward,
                   "reward/unscorable_dropped": float(every.isnan().sum())}
        if self.agent is not None:
            metrics.update(self.agent_metrics(rollout))
        valid = ~scores.isnan()
        self.kept = valid.nonzero().squeeze(-1).tolist()
        self.n_sampled = int(valid.numel())
        if not bool(valid.all()):
            rollout = rollout.select(valid.nonzero().squeeze(-1))
        return rollout, scores[valid], metrics

    @torch.no_grad()
    def prepare(self, rollout: Rollout, scores: Tensor, metrics: dict[str, float]) -> Rollout:
        """3 + 4: old log-probs (the training forward itself, so the first ratio is 1 in every
        precision), reference KL, values, per-token rewards, GAE; all kept on the rollout.
        Forwards read `attention_mask` (an episode's tool answers too), the rest takes only
        `response_mask` (the model's tokens)."""
        cfg = self.cfg
        dev = self.device  # the rollout is there already (`sample_prompts` moved it)
        p_ids, p_mask = rollout.prompt_ids, rollout.prompt_mask
        c_ids, mask, attn = rollout.completion_ids, rollout.response_mask, rollout.attention_mask
        args = (p_ids, p_mask, c_ids, attn, cfg.micro_batch_size)
        old_logprobs = self.forward.batched(self.model, *args)  # [n, T]
        correction = cfg.rollout_correction()
        sampled = rollout.logprobs  # [n, T] the sampler's log-probs
        is_weights, _ = rollout_weights(old_logprobs, sampled, mask, correction,
                                        cfg.rollout_is_cap)  # [n, T]
        n_tok = float(mask.sum())  # this rank's tokens: the weight of its token means
        metrics.update(weighted({k: float(v) for k, v in rollout_metrics(
            old_logprobs, sampled, mask, correction, cfg.rollout_is_cap).items()}, n_tok))
        values = keep(self.batched_values(p_ids, p_mask, c_ids, attn), mask)  # [n, T]
        beta, kl = self.kl_ctl.value, None
        if cfg.kl_coef > 0:
            with self.reference() as ref:
                ref_logprobs = self.forward.batched(ref, *args)  # [n, T]
            kl = keep(kl_penalty(old_logprobs, ref_logprobs, kind=cfg.kl_estimator,
                                 clamp=cfg.kl_clamp), mask)
            seq_kl = kl.sum(-1)  # [n]
            n_all = self.dist.sum(float(seq_kl.numel()))
            kl_mean = self.dist.sum(float(seq_kl.sum())) / max(n_all, 1.0)  # over all ranks
            metrics.update({"kl/mean": kl_mean,
                            "kl/token_mean": self.dist.sum(float(kl.sum()))
                            / max(self.dist.sum(float(mask.sum())), 1.0),
                            "reward/kl_penalty": beta * kl_mean})
            self.kl_ctl.update(kl_mean, n_steps=int(n_all))
        rewards = token_rewards(scores.to(dev), mask, kl, beta)  # [n, T]
        advantages, returns = ppo_advantages(rewards, values, mask, cfg.gamma, cfg.gae_lambda,
                                             cfg.whiten_advantages, self.sum_over_ranks)
        metrics.update({"kl/coef": beta, **weighted({
            "critic/value_mean": float(masked_mean(values, mask)),
            "critic/return_mean": float(masked_mean(returns, mask))}, n_tok), **weighted({
            "reward/shaped_mean": float(rewards.sum(-1).mean())}, rewards.shape[0]),
            "critic/explained_variance": float(explained_variance(values, returns, mask,
                                                                  self.sum_over_ranks))})
        rollout.old_logprobs, rollout.values, rollout.is_weights = old_logprobs, values, is_weights
        rollout.advantages, rollout.returns = advantages, returns
        return rollout

    @torch.no_grad()
    def batched_values(self, p_ids: Tensor, p_mask: Tensor, c_ids: Tensor,
                       mask: Tensor) -> Tensor:
        """Critic values [N, T] in micro-batches, no gradients (`mask`: the tokens read)."""
        n, size = p_ids.shape[0], self.cfg.micro_batch_size
        return torch.cat([self.critic(p_ids[i:i + size], p_mask[i:i + size], c_ids[i:i + size],
                                      mask[i:i + size], self.forward.autocast,
                                      self.forward.packing) for i in range(0, n, size)])

    # ------------------------------------------------------------------------------------------
    def ppo_update(self, batch: Rollout, train_policy: bool = True) -> dict[str, float]:
        """5: epochs x shuffled mini-batches through the one update; early stop when the
        mini-batch's approx KL (over every rank) > target_kl."""
        cfg = self.cfg
        plan = local_plan(self.n_sampled, cfg.group_size, self.dist, cfg.micro_batch_size,
                          rows=self.kept, epochs=cfg.ppo_epochs, mini_batches=cfg.mini_batches,
                          seed=sequence_seed(cfg.seed, self._step, "update"),
                          micro_batch_tokens=cfg.micro_batch_tokens,
                          widths=row_widths(batch.prompt_mask, batch.attention_mask))
        lengths = batch.response_mask.sum(-1).cpu()  # [n]
        kept = (batch.is_weights > 0).sum(-1).cpu()  # [n] tokens the policy loss counts
        rejects = cfg.rollout_correction().endswith("_mask")
        if train_policy and rejects and self.dist.sum(float(kept.sum())) == 0:
            if self.dist.is_main:
                print(all_rejected_warning(self.name, self._step, cfg,
                                           "only the critic trains this step."),
                      file=sys.stderr)
            train_policy = False

        def counts(idx: list[int]) -> dict[str, float]:
            seqs = float(len(idx))
            return {"tokens": float(lengths[idx].sum()), "seqs": seqs,
                    "policy_tokens": float(kept[idx].sum()),
                    "policy_seqs": float((kept[idx] > 0).sum()) if rejects else seqs}

        def loss_fn(idx: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            micro = batch.select(torch.tensor(idx, dtype=torch.long))
            loss, metrics = self.micro_loss(micro, totals, train_policy)
            return loss, metrics, float(lengths[idx].sum())

        at_stop: list[float] = []

        def early_stop(m: dict[str, float]) -> bool:
            stop = (train_policy and cfg.target_kl is not None
                    and m["policy/approx_kl"] > cfg.target_kl)
            if stop:
                at_stop.append(m["policy/approx_kl"])
            return stop

        groups = self.groups if train_policy else self.groups[1:]
        out = self.optimize(plan, counts, loss_fn, groups=groups, before_step=early_stop)
        stopped = out.pop("train/early_stopped", 0.0) > 0
        self.early_stops += int(stopped)
        if at_stop:
            out["policy/approx_kl_at_stop"] = at_stop[0]
        out.update({"ppo/updates": out.pop("train/optimizer_steps"),
                    "ppo/early_stopped": float(stopped),
                    "train/lr": self.groups[0].sched.get_last_lr()[0],
                    "critic/lr": self.groups[1].sched.get_last_lr()[0]})
        return out

    def micro_loss(self, micro: Rollout, totals: dict[str, float],
                   train_policy: bool) -> tuple[Tensor, dict[str, Any]]:
        """One micro-batch's ``L_policy - c_e H + c_v L_V`` (policy terms only when
        `train_policy`), normalised over the whole mini-batch (`totals`: its token and
        sequence counts; the policy's without the tokens a `*_mask` rollout correction
        rejects); policy and critic share no trainable weight, so one backward gives each its
        own gradient."""
        cfg = self.cfg
        norms = {"total_tokens": totals["tokens"], "total_seqs": totals["seqs"]}
        out: dict[str, Any] = {}
        loss = torch.zeros((), device=self.device)
        if train_policy:
            logprobs, entropy = self.forward.logprobs(
                self.model, micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                micro.attention_mask, with_entropy=True, entropy_grad=cfg.ent_coef > 0)
            corrected = cfg.rollout_correction() != "none"
            p_mask = micro.response_mask & (micro.is_weights > 0)  # [n, T]
            p_loss, metrics = policy_loss(
                logprobs, micro.old_logprobs, micro.advantages, p_mask,
                ratio_level="token", eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
                loss_agg=cfg.loss_agg, max_len=cfg.max_new_tokens, dual_clip=cfg.dual_clip,
                total_tokens=totals["policy_tokens"], total_seqs=totals["policy_seqs"],
                weights=micro.is_weights if corrected else None)
            ent = aggregate_loss(entropy, micro.response_mask, cfg.loss_agg, cfg.max_new_tokens,
                                 totals["tokens"], totals["seqs"])
            loss = p_loss - cfg.ent_coef * ent if cfg.ent_coef else p_loss
            out.update(metrics)
            out.update({"loss/policy": p_loss.detach(), "loss/entropy": ent.detach(),
                        "policy/entropy": masked_mean(entropy.detach(), micro.response_mask)})
        values = self.critic(micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                             micro.attention_mask, self.forward.autocast,
                             self.forward.packing)  # [n, T]
        v_loss, v_metrics = value_loss(values, micro.values, micro.returns,
                                       micro.response_mask, cfg.value_clip, "token-mean",
                                       **norms)
        out.update({"loss/value": v_loss.detach(),
                    "critic/vf_clipfrac": v_metrics["critic/vf_clipfrac"]})
        return loss + cfg.vf_coef * v_loss, out

    # ------------------------------------------------------------------------------------------
    def summary_fields(self) -> dict[str, Any]:
        return {"kl_coef_final": self.kl_ctl.value, "early_stopped_steps": self.early_stops,
                "critic": ("lora adapter on the policy's base" if self.cfg.lora_r > 0 else
                           self.cfg.critic_model or "copy of the policy")}

    def save(self, path: str) -> None:
        if path.endswith("final"):  # before the policy's adapters are merged away
            self.critic.save(f"{self.cfg.out_dir}/critic")
        super().save(path)

