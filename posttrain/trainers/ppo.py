"""PPO for RLHF: actor, critic, frozen reference and reward functions / a reward model.

One step (numbered as in the code):
1. generate completions with the current policy (the shared rollout);
2. score each completion (verifiable rewards and/or a reward model, weighted sum R);
3. with no gradients: the rollout policy's log-probs (the "old" policy of the ratio), the
   reference's log-probs, the critic's values; per-token rewards ``-beta * KL[t]`` plus R on the
   last real token (Ziegler et al. 2019, arXiv:1909.08593; InstructGPT, arXiv:2203.02155);
4. GAE advantages and returns (Schulman et al. 2015, arXiv:1506.02438) with V = 0 after the
   last token, optionally whitened;
5. ``ppo_epochs`` passes x ``mini_batches`` optimizer steps of the clipped policy loss (PPO,
   arXiv:1707.06347) and the clipped value loss, with an entropy bonus, gradient clipping,
   critic warm-up steps and early stopping on approx KL > ``target_kl``.
All formulas are ``posttrain.ops`` functions (docs/algorithms.md); this file orchestrates.

Deliberate choices (docs/ppo.md):
- Policy and critic never share trainable weights (a separate body, or a separate LoRA adapter
  on one frozen base), so each has its own AdamW, learning rate and gradient clipping; the
  total loss ``L_policy + c_v L_V - c_e H`` then splits into independent updates.
- The old log-probs are recomputed with the training forward pass (not the sampler's decode
  numbers), so the first update's ratio is 1 up to float rounding and approx KL starts at 0.
- A completion whose score is unscorable (NaN) is dropped and counted (`reward/unscorable`).
- Early stop stops both the policy and the critic for the rest of the step.

Notation: N sequences in the step, T completion tokens.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.config.ppo import PPOConfig
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
    entropy_from_logits,
    explained_variance,
    gae,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    token_logprobs,
    value_loss,
)
from posttrain.ops.masked import as_bool_mask, keep
from posttrain.rollout import SamplingParams, generate
from posttrain.trainers.base import Trainer
from posttrain.trainers.common import build_optimizer
from posttrain.trainers.forward import batched_logprobs, completion_logits


# ----------------------------------------------------------------------------------------------
# Pure pieces
# ----------------------------------------------------------------------------------------------
def last_token_index(response_mask: Tensor) -> Tensor:
    """[N] index of each row's last real completion token (the mask may have holes)."""
    mask = as_bool_mask(response_mask)  # [N, T]
    if not bool(mask.any(-1).all()):
        raise ValueError("every completion needs at least one real token to carry its score")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)  # [N, T]
    return torch.where(mask, positions, -1).amax(-1)  # [N]


def token_rewards(scores: Tensor, response_mask: Tensor, kl: Tensor | None = None,
                  beta: float = 0.0) -> Tensor:
    """Per-token PPO rewards: ``-beta * kl[t]`` on real tokens plus the score on the last one.

    Args:
        scores: [N] sequence scores R. response_mask: [N, T]. kl: [N, T] per-token KL estimate
        (or None). beta: KL coefficient.
    Returns:
        [N, T] rewards, 0 on masked slots.
    """
    mask = as_bool_mask(response_mask)
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [N, T]
    if kl is not None and beta != 0.0:
        rewards = keep(-beta * kl.float(), mask)  # [N, T]
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards)
    return rewards


def ppo_advantages(rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float,
                   lam: float, whiten: bool) -> tuple[Tensor, Tensor]:
    """GAE (``posttrain.ops.gae``, V = 0 past the last token), then optional whitening.

    Returns (advantages [N, T], returns [N, T]); returns are never whitened (critic targets).
    """
    advantages, returns = gae(rewards, values, response_mask, gamma, lam)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@dataclass
class PPOBatch:
    """What the PPO epochs need about one rollout; every field is [N, ...] on the device."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    response_mask: Tensor
    old_logprobs: Tensor
    old_values: Tensor
    advantages: Tensor
    returns: Tensor

    @property
    def size(self) -> int:
        return int(self.prompt_ids.shape[0])

    def select(self, idx: Tensor) -> PPOBatch:
        return PPOBatch(**{f.name: getattr(self, f.name)[idx.to(self.prompt_ids.device)]
                           for f in dataclasses.fields(self)})


class _Params:
    """A parameter list that `build_optimizer` can read like a module."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = params

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params


def clip_and_step(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
                  sched: Any, max_grad_norm: float) -> float:
    """Clip the global norm of `params`' gradients, step, schedule, zero; pre-clip norm."""
    limit = max_grad_norm if max_grad_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------
class PPOTrainer(Trainer):
    """PPO with a learned critic on a prompt dataset with reward functions / a reward model."""

    name = "ppo"
    config_class = PPOConfig
    data_kind = "prompts"
    progress_keys = ("reward/mean", "reward/accuracy", "kl/coef")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg: PPOConfig = self.cfg
        # the policy's own parameters (with LoRA the base's optimizer also saw the critic
        # adapter: rebuild it over the policy adapter only)
        self.policy_params = [p for n, p in self.model.named_parameters()
                              if p.requires_grad and f".{CRITIC_ADAPTER}." not in f".{n}."]
        if cfg.lora_r > 0:
            self.opt, self.sched = build_optimizer(_Params(self.policy_params), cfg,
                                                   self.optimizer_steps())
        self.critic_params = self.critic.trainable_parameters()
        self.critic_opt, self.critic_sched = build_optimizer(
            _Params(self.critic_params), dataclasses.replace(cfg, lr=cfg.critic_lr),
            self.optimizer_steps())
        self.early_stops = 0

    def setup(self) -> None:
        cfg: PPOConfig = self.cfg
        if cfg.kl_coef > 0:
            self.load_reference()  # none with LoRA: the adapters-off base is the reference
        self.critic = self.build_critic().to(self.device)
        self.kl_ctl = (AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
                       if cfg.adaptive_kl else FixedKLController(cfg.kl_coef))
        self.sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k)

    def build_critic(self) -> ValueModel:
        """The critic (see posttrain.models.value_head): shared-base LoRA adapter, a model from
        `critic_model`, or a copy of the policy's body."""
        cfg: PPOConfig = self.cfg
        if cfg.lora_r > 0:
            return shared_lora_critic(self.model, cfg.lora_r, cfg.lora_alpha,
                                      cfg.lora_target_modules)
        if cfg.critic_model:
            return load_critic(cfg.critic_model)
        return critic_from_policy(self.model)

    def optimizer_steps(self) -> int:
        return self.cfg.max_steps * self.cfg.ppo_epochs * self.cfg.mini_batches

    # ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        t0 = time.time()
        rollout, scores, metrics = self.rollout_and_score()  # 1 generate, 2 score
        t1 = time.time()
        batch = self.prepare(rollout, scores, metrics)  # 3 old log-probs, ref, values; 4 GAE
        t2 = time.time()
        metrics.update(self.ppo_update(batch, train_policy=step > self.cfg.critic_warmup_steps))
        n_tok = float(batch.response_mask.sum())
        metrics.update({"perf/rollout_seconds": t1 - t0, "perf/prepare_seconds": t2 - t1,
                        "perf/train_seconds": time.time() - t2,
                        "perf/train_tokens_per_sec": n_tok / max(time.time() - t2, 1e-9)})
        return metrics

    def rollout_and_score(self) -> tuple[Any, Tensor, dict[str, float]]:
        """1 + 2: sample `group_size` completions per prompt and score them; drop unscorable."""
        cfg: PPOConfig = self.cfg
        rows = self.next_rows(cfg.prompts_per_step)
        prompts = [self.s.render(r[cfg.prompt_field]) for r in rows]
        sampler, autocast = self.rollout_model()  # under autocast_bf16: a synced bf16 copy
        rollout = generate(sampler, self.tokenizer, prompts, group_size=cfg.group_size,
                           rows=rows, params=self.sampling, autocast=autocast,
                           generator=self.gen)
        result = self.s.scorer.score(rollout.completions, rollout.rows)
        self.s.log_reward_errors(result.errors)
        scores = torch.tensor(result.scores, dtype=torch.float32)  # [N]
        valid = ~scores.isnan()
        metrics = dict(result.metrics)
        metrics.update({
            "reward/mean": float(scores[valid].mean()) if bool(valid.any()) else float("nan"),
            "reward/std": float(scores[valid].std()) if int(valid.sum()) > 1 else 0.0,
            "reward/accuracy": float((scores[valid] >= 1.0).float().mean())
            if bool(valid.any()) else float("nan"),
            "reward/unscorable_dropped": float((~valid).sum()),
            "response/length_mean": float(rollout.response_mask.sum(1).float().mean()),
            "response/truncated_frac": float(rollout.truncated.float().mean()),
        })
        if not bool(valid.all()):
            rollout = rollout.select(valid.nonzero().squeeze(-1))
        return rollout, scores[valid], metrics

    @torch.no_grad()
    def prepare(self, rollout: Any, scores: Tensor, metrics: dict[str, float]) -> PPOBatch:
        """3 + 4: old log-probs, reference KL, values, per-token rewards, GAE."""
        cfg: PPOConfig = self.cfg
        dev = self.device
        p_ids, p_mask = rollout.prompt_ids.to(dev), rollout.prompt_mask.to(dev)
        c_ids, mask = rollout.completion_ids.to(dev), rollout.response_mask.to(dev)
        args = (p_ids, p_mask, c_ids, mask, cfg.micro_batch_size, cfg.temperature,
                cfg.autocast_bf16)
        share = {"share_prefix": self.share_prefix}  # group_size > 1: prompts repeat
        old_logprobs = batched_logprobs(self.model, *args, **share)  # [N, T]
        values = self.batched_values(p_ids, p_mask, c_ids, mask)  # [N, T]
        beta, kl = self.kl_ctl.value, None
        if cfg.kl_coef > 0:
            with self.reference() as ref:
                ref_logprobs = batched_logprobs(ref, *args, **share)  # [N, T]
            kl = keep(kl_penalty(old_logprobs, ref_logprobs, kind=cfg.kl_estimator), mask)
            seq_kl = kl.sum(-1)  # [N]
            metrics.update({"kl/mean": float(seq_kl.mean()),
                            "kl/token_mean": float(masked_mean(kl, mask)),
                            "reward/kl_penalty": float(beta * seq_kl.mean())})
            self.kl_ctl.update(seq_kl.mean(), n_steps=int(mask.shape[0]))
        rewards = token_rewards(scores.to(dev), mask, kl, beta)  # [N, T]
        advantages, returns = ppo_advantages(rewards, values, mask, cfg.gamma, cfg.gae_lambda,
                                             cfg.whiten_advantages)
        metrics.update({
            "kl/coef": beta,
            "critic/value_mean": float(masked_mean(values, mask)),
            "critic/explained_variance": float(explained_variance(values, returns, mask)),
            "critic/return_mean": float(masked_mean(returns, mask)),
            "reward/shaped_mean": float(rewards.sum(-1).mean()),
        })
        return PPOBatch(p_ids, p_mask, c_ids, mask, old_logprobs, values, advantages, returns)

    @torch.no_grad()
    def batched_values(self, p_ids: Tensor, p_mask: Tensor, c_ids: Tensor,
                       mask: Tensor) -> Tensor:
        """Critic values [N, T] in micro-batches, no gradients."""
        n, size = p_ids.shape[0], self.cfg.micro_batch_size
        return torch.cat([self.critic(p_ids[i:i + size], p_mask[i:i + size], c_ids[i:i + size],
                                      mask[i:i + size], self.cfg.autocast_bf16)
                          for i in range(0, n, size)])

    # ------------------------------------------------------------------------------------------
    def ppo_update(self, batch: PPOBatch, train_policy: bool = True) -> dict[str, float]:
        """5: epochs x shuffled mini-batches; early stop when approx KL > target_kl."""
        cfg: PPOConfig = self.cfg
        acc: dict[str, list[float]] = {}
        updates, stopped = 0, False
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(batch.size, generator=self.gen)
            for idx in perm.chunk(cfg.mini_batches):
                m = self.minibatch_backward(batch.select(idx), train_policy)
                if (train_policy and cfg.target_kl is not None
                        and m["policy/approx_kl"] > cfg.target_kl):
                    self.opt.zero_grad(set_to_none=True)
                    self.critic_opt.zero_grad(set_to_none=True)
                    stopped = True
                    acc.setdefault("policy/approx_kl_at_stop", []).append(m["policy/approx_kl"])
                    break
                if train_policy:
                    m["policy/grad_norm"] = clip_and_step(self.policy_params, self.opt,
                                                          self.sched, cfg.max_grad_norm)
                m["critic/grad_norm"] = clip_and_step(self.critic_params, self.critic_opt,
                                                      self.critic_sched, cfg.max_grad_norm)
                updates += 1
                for k, v in m.items():
                    acc.setdefault(k, []).append(v)
            if stopped:
                break
        self.early_stops += int(stopped)
        out = {k: sum(v) / len(v) for k, v in acc.items()}
        out.update({"ppo/updates": float(updates), "ppo/early_stopped": float(stopped),
                    "train/lr": self.sched.get_last_lr()[0],
                    "critic/lr": self.critic_sched.get_last_lr()[0]})
        return out

    def minibatch_backward(self, mb: PPOBatch, train_policy: bool) -> dict[str, float]:
        """Forward + backward of one mini-batch in micro-batches; losses are normalised over the
        whole mini-batch, so the accumulated gradient equals one big batch's. Metrics are
        token-weighted means over the micro-batches (losses: sums)."""
        cfg: PPOConfig = self.cfg
        total_tokens = float(mb.response_mask.sum())
        total_seqs = float(mb.size)
        sums: dict[str, float] = {}
        for idx in torch.arange(mb.size).split(cfg.micro_batch_size):
            micro = mb.select(idx)
            share = float(micro.response_mask.sum()) / max(total_tokens, 1.0)
            parts: dict[str, float] = {}
            if train_policy:
                parts.update(self.policy_backward(micro, total_tokens, total_seqs))
            values = self.critic(micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                 micro.response_mask, cfg.autocast_bf16)  # [n, T]
            v_loss, v_metrics = value_loss(values, micro.old_values, micro.returns,
                                           micro.response_mask, cfg.value_clip, "token-mean",
                                           total_tokens=total_tokens, total_seqs=total_seqs)
            (cfg.vf_coef * v_loss).backward()
            parts["loss/value"] = float(v_loss.detach())
            parts["critic/vf_clipfrac"] = float(v_metrics["critic/vf_clipfrac"])
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + (v if k.startswith("loss/") else v * share)
        return sums

    def policy_backward(self, micro: PPOBatch, total_tokens: float,
                        total_seqs: float) -> dict[str, float]:
        """Clipped policy loss minus the entropy bonus for one micro-batch; backward."""
        cfg: PPOConfig = self.cfg
        logprobs, entropy = self.policy_forward(micro)  # [n, T] each
        loss, metrics = policy_loss(
            logprobs, micro.old_logprobs, micro.advantages, micro.response_mask,
            ratio_level="token", eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
            loss_agg=cfg.loss_agg, max_len=cfg.max_new_tokens, dual_clip=cfg.dual_clip,
            total_tokens=total_tokens, total_seqs=total_seqs)
        ent = aggregate_loss(entropy, micro.response_mask, cfg.loss_agg, cfg.max_new_tokens,
                             total_tokens, total_seqs)
        (loss - cfg.ent_coef * ent).backward() if cfg.ent_coef else loss.backward()
        out = {k: float(v) for k, v in metrics.items()}
        out.update({"loss/policy": float(loss.detach()), "loss/entropy": float(ent.detach()),
                    "policy/entropy": float(masked_mean(entropy.detach(),
                                                        micro.response_mask))})
        return out

    def policy_forward(self, micro: PPOBatch) -> tuple[Tensor, Tensor]:
        """Log-probs [n, T] and entropies [n, T] (with gradient when ent_coef > 0)."""
        cfg: PPOConfig = self.cfg
        logits = completion_logits(self.model, micro.prompt_ids, micro.prompt_mask,
                                   micro.completion_ids, micro.response_mask,
                                   cfg.autocast_bf16, self.share_prefix)  # [n, T', V]
        t_cut, t_full = logits.shape[1], micro.completion_ids.shape[1]
        logprobs = token_logprobs(logits, micro.completion_ids[:, :t_cut], cfg.temperature)
        with torch.set_grad_enabled(cfg.ent_coef > 0 and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits, temperature=cfg.temperature)  # [n, T']
        pad = (0, t_full - t_cut)
        return torch.nn.functional.pad(logprobs, pad), torch.nn.functional.pad(entropy, pad)

    # ------------------------------------------------------------------------------------------
    def summary_fields(self) -> dict[str, Any]:
        return {"kl_coef_final": self.kl_ctl.value, "early_stopped_steps": self.early_stops,
                "critic": ("lora adapter on the policy's base" if self.cfg.lora_r > 0 else
                           self.cfg.critic_model or "copy of the policy")}

    def save(self, path: str) -> None:
        if path.endswith("final"):  # before the policy's adapters are merged away
            self.critic.save(f"{self.cfg.out_dir}/critic")
        super().save(path)
