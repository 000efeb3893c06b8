"""GRPO and its presets (GSPO, DAPO, Dr. GRPO) with verifiable or learned rewards.

One step: 1 generate G completions per prompt -> 2 score them -> 3 group-relative advantages ->
4 clipped policy-gradient update(s). The variants are choices along axes of `GRPOConfig`
(advantage, scale, ratio_level, loss_agg, KL placement), all computed by `posttrain.ops`.
Deliberate choices: a group with an unscorable sample is dropped whole (`reward/unscorable`);
`kl_placement: reward` subtracts beta * sum of per-token KL from each score before the group
normalisation; with one optimizer step per rollout the old log-probs are the detached current
ones (no extra forward). `advantage: grpo_process` adds `process_weight` times the PRM's
process advantages (`posttrain.trainers.process_steps`); a learned reward run logs
`reward/verifier_accuracy`. Shuffles seeded by (seed, step) and all ranks' normalisers make
rollouts and updates independent of the number of ranks and the resume point.
More: docs/algorithms.md, "Module notes", posttrain.trainers.grpo.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.config import ConfigError, GRPOConfig
from posttrain.core.runtime import sequence_seed
from posttrain.engine.distributed import weighted
from posttrain.engine.update import local_plan, row_widths
from posttrain.ops import (
    aggregate_loss,
    group_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
    process_advantages,
    rloo_advantages,
    rollout_metrics,
    rollout_weights,
)
from posttrain.rollout import Rollout, concat_rollouts
from posttrain.trainers.process_steps import (
    StepScorer,
    annotate_dump,
    build_step_scorer,
    check_process_reward_model,
    step_tensors,
)
from posttrain.trainers.prompt_rl import PromptRLTrainer, all_rejected_warning

LEARNED_REWARDS = ("reward_model", "process_reward_model")


class GRPOTrainer(PromptRLTrainer):
    """Group-relative policy optimisation on a prompt dataset with reward functions."""

    name = "grpo"
    supports_bf16_compute = True
    supports_tools = True
    supports_token_budget = supports_packing = True  # packing: every forward is the policy's
    config_class = GRPOConfig
    progress_keys = ("reward/mean", "reward/accuracy", "response/truncated_frac")
    count_metrics = PromptRLTrainer.count_metrics | {"rollout/groups_used",
                                                     "reward/dropped_groups",
                                                     "async/dropped_stale"}
    cfg: GRPOConfig
    defer_truncated_weights = True
    """Take a truncated correction's pi_old from the update's own forward when the step makes
    one update (tests turn it off to compare with the extra pass)."""

    def validate(self) -> None:
        if self.cfg.advantage == "grpo_process":  # before any model loads
            try:
                check_process_reward_model(self.cfg.process_reward_model)
            except ValueError as err:
                raise ConfigError(str(err)) from err
        super().validate()
        if self.dist.world > 1 and self.cfg.scale == "batch":
            raise ConfigError("config key 'scale'='batch': its statistics would cross ranks; "
                              "use 'group' or 'none' under torchrun")

    def setup(self) -> None:
        # the reference: none without KL; with LoRA the policy with adapters off; else a copy
        if self.cfg.kl_coef > 0:
            self.load_reference()
        cfg = self.cfg
        self._times = {"gen": 0.0, "score": 0.0}
        self.step_scorer: StepScorer | None = None
        if cfg.advantage == "grpo_process":
            self.step_scorer = build_step_scorer(cfg.process_reward_model, device=cfg.device)
        names = self.session.reward_names
        learned = self.step_scorer is not None or any(n in LEARNED_REWARDS for n in names)
        self.verifier = self.accuracy_from if learned else None
        if learned and self.verifier is None:
            print("[grpo] warning: training on a learned reward without a verifier in `rewards`"
                  " (add {name: math, weight: 0}): reward/verifier_accuracy is not logged")
        self._step, self._drawn, self._deferred = 0, 0, False
        self._verdicts: list[float] = []  # this step's verifier verdicts (all rounds)
        if cfg.async_rollouts:  # the progress bar shows the lag and the queue
            self.progress_keys = (*self.progress_keys, "async/staleness_mean",
                                  "async/queue_groups")
            self.rollouts_async.spawn()

    def state_dict(self) -> dict[str, Any]:
        return {"async": self.rollouts_async.state()} if self.rollouts_async else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "async" in state:
            self.rollouts_async.load(state["async"])

    def optimizer_steps(self) -> int:
        return self.cfg.max_steps * self.cfg.num_iterations * self.cfg.mini_batches

    def step(self, step: int) -> dict[str, float]:
        self._times = {"gen": 0.0, "score": 0.0}
        self._step, self._drawn = step, 0  # sampling seeds: (seed, step, prompt, sample)
        rollout, metrics = self.rollout_step()  # 1 generate, 2 score
        self.compute_advantages(rollout, metrics)  # 3 reference log-probs, advantages
        t1 = time.time()
        metrics.update(self.update(rollout))  # 4 clipped policy-gradient update(s)
        t_train, t_gen = time.time() - t1, self._times["gen"]
        if self.rollouts_async:  # 5 the new weights to the sampler process
            pushed = self.rollouts_async.push(step)
            metrics["async/learner_wait_s"] += pushed.pop("async/learner_wait_s", 0.0)
            metrics.update(pushed)
        metrics.update({"perf/gen_seconds": t_gen, "perf/score_seconds": self._times["score"],
                        "perf/train_seconds": t_train,
                        "perf/gen_tokens_per_sec": metrics.pop("_gen_tokens") / max(t_gen, 1e-9),
                        "perf/train_tokens_per_sec":
                        float(rollout.response_mask.sum()) / max(t_train, 1e-9)})
        return metrics

    # ------------------------------------------------------------------------------------------
    def sample_and_score(self, n_prompts: int) -> tuple[Rollout, dict[str, float]]:
        """Draw `n_prompts` prompts (rounded up to equal shares), sample and score them."""
        n_prompts = -(-n_prompts // self.dist.world) * self.dist.world
        rollout, result, seconds = self.sample_prompts(n_prompts, self._drawn)
        self._drawn += n_prompts
        for k, v in seconds.items():
            self._times[k] += v
        metrics = dict(result.metrics)
        if self.agent is not None:
            metrics.update(self.agent_metrics(rollout))
        if self.accuracy_from is not None:
            self._verdicts += result.per_function[self.accuracy_from]
        if self.verifier is not None:  # the reward-hacking watch: the verifier at any weight
            verdicts = [v for v in result.per_function[self.verifier] if v == v]
            metrics["reward/verifier_accuracy"] = (
                sum(v >= 1.0 for v in verdicts) / len(verdicts) if verdicts else float("nan"))
        return rollout, metrics

    def rollout_step(self) -> tuple[Rollout, dict[str, float]]:
        """1 generate + 2 score, with whole-group filtering (unscorable; DAPO dynamic sampling)."""
        cfg, G = self.cfg, self.cfg.group_size
        self._verdicts = []
        rollout, metrics = self.sample_and_score(cfg.prompts_per_step)
        all_scores, gen_tokens = [rollout.scores], float(rollout.response_mask.sum())
        kept = [self._filter_groups(rollout, metrics)]
        n_groups = int(self.dist.sum(kept[0].num_sequences // G))
        rounds = 0
        while (cfg.dynamic_sampling and n_groups < cfg.prompts_per_step
               and rounds < cfg.dynamic_sampling_max_rounds):
            rounds += 1
            extra, m = self.sample_and_score(cfg.prompts_per_step - n_groups)
            all_scores.append(extra.scores)
            gen_tokens += float(extra.response_mask.sum())
            for k, v in m.items():
                summed = "errors" in k or "code/" in k or k.startswith("agent/")
                metrics[k] = metrics.get(k, 0.0) + v if summed else v
            kept.append(self._filter_groups(extra, metrics))
            n_groups += int(self.dist.sum(kept[-1].num_sequences // G))
        # [all sampled on all ranks], group-contiguous: reward metrics over the whole step
        verdicts = self._verdicts if self.accuracy_from is not None else None
        scores, reward = self.reward_metrics(torch.cat(all_scores), rollout, verdicts)
        metrics.update({"_gen_tokens": gen_tokens, **reward,
                        "reward/frac_zero_std_groups":
                        float((scores.view(-1, G).std(1) == 0).float().mean()),
                        "rollout/dynamic_sampling_rounds": float(rounds)})
        out = concat_rollouts(kept, self.tokenizer.pad_token_id)
        metrics["rollout/groups_used"] = float(out.num_sequences // G)
        return out, metrics

    def _filter_groups(self, rollout: Rollout, metrics: dict[str, float]) -> Rollout:
        """Drop groups with an unscorable member, and (dynamic sampling) all-equal groups."""
        G = self.cfg.group_size
        grouped = rollout.scores.view(-1, G)  # [B, G]
        keep = ~grouped.isnan().any(1)  # [B]
        if self.cfg.dynamic_sampling:
            keep &= grouped.nan_to_num(0.0).std(1) > 0
        metrics["reward/dropped_groups"] = metrics.get("reward/dropped_groups", 0.0) + float(
            (~keep).sum())
        idx = torch.arange(rollout.num_sequences).view(-1, G)[keep].flatten()
        return rollout.select(idx) if int(keep.sum()) < keep.numel() else rollout

    # ------------------------------------------------------------------------------------------
    def compute_advantages(self, rollout: Rollout, metrics: dict[str, float]) -> None:
        """3: reference log-probs (if KL is used), KL-in-reward shaping, group advantages."""
        cfg = self.cfg
        off_policy = not (cfg.num_iterations == 1 and cfg.mini_batches == 1)
        kl_in_reward = cfg.kl_coef > 0 and cfg.kl_placement == "reward"
        correction = cfg.rollout_correction()
        # a truncated correction of one update: its weights come from the update's own forward
        # (pi_old is the policy being updated), without a pass of their own
        self._deferred = (self.defer_truncated_weights and correction.endswith("truncate")
                          and not (off_policy or kl_in_reward))
        need_old = off_policy or kl_in_reward or (correction != "none" and not self._deferred)
        # old log-probs: the sampler's where they equal the learner's forward (fp32, no
        # correction asked), else one learner forward, so a ratio or a KL starts at exactly 0
        # in every precision and the correction compares the learner with the sampler
        reuse = (cfg.old_logprobs == "rollout" and correction == "none"
                 and cfg.rollout_engine == "hf" and not (cfg.autocast_bf16 or cfg.bf16_compute)
                 and self.agent is None)  # episodes: each turn decodes a re-prefilled context
        if rollout.num_sequences == 0:  # every group of this rank was filtered out
            rollout.advantages = torch.zeros(0)
            self._join_gathers(need_old and not reuse)
            return
        scores = rollout.scores.to(rollout.logprobs.device)  # [N]
        if need_old:
            rollout.old_logprobs = rollout.logprobs if reuse else self.policy_logprobs(rollout)
        if correction != "none" and not self._deferred:  # [N, T] pi_old / q, 0: masked
            gap = (rollout.old_logprobs, rollout.logprobs, rollout.response_mask, correction,
                   cfg.rollout_is_cap)
            rollout.is_weights, _ = rollout_weights(*gap)
            metrics.update(weighted({k: float(v) for k, v in rollout_metrics(*gap).items()},
                                    float(rollout.response_mask.sum())))  # this rank's tokens
        if cfg.kl_coef > 0:
            with self.reference() as ref:
                rollout.ref_logprobs = self.policy_logprobs(rollout, ref)
            if kl_in_reward:
                kl = kl_penalty(rollout.old_logprobs, rollout.ref_logprobs,
                                kind=cfg.kl_estimator, clamp=cfg.kl_clamp)  # [N, T]
                seq_kl = (kl * rollout.response_mask).sum(-1)  # [N]
                scores = scores - cfg.kl_coef * seq_kl
                metrics["kl/seq_mean"] = float(seq_kl.mean())
        if cfg.advantage == "rloo":
            adv = rloo_advantages(scores, cfg.group_size)
        elif cfg.advantage == "grpo_process":
            adv = self.process_step_advantages(rollout, scores, metrics)  # [N, T]
        else:
            adv = group_advantages(scores, cfg.group_size, scale=cfg.scale,
                                   std_ddof=cfg.std_ddof)
        rollout.advantages = adv  # [N]
        metrics["advantage/abs_mean"] = float(  # [N, T] (process): counted tokens only
            masked_mean(adv.abs(), rollout.response_mask) if adv.dim() == 2 else adv.abs().mean())
        if not off_policy:
            rollout.old_logprobs = None  # on-policy: old = detached current, no extra pass

    def _join_gathers(self, policy_pass: bool) -> None:
        """Under FSDP2, a rank with nothing to score still joins the all-gathers of the other
        ranks' no-grad passes (policy, then reference), or they would wait for it forever."""
        if not self.dist.fsdp:
            return
        if policy_pass:
            with self.dist.gathered(self.learner()):
                pass
        if self.cfg.kl_coef > 0:
            with self.reference() as ref, self.dist.gathered(ref):
                pass

    def score_steps(self, rollout: Rollout) -> None:
        """Step ends and step scores of every completion, stored in the rollout."""
        if self.step_scorer is None:
            raise RuntimeError("score_steps needs advantage=grpo_process (no step scorer)")
        t0 = time.time()
        prompts = [r["prompt"] for r in rollout.rows]
        steps = self.step_scorer(prompts, rollout.completions)
        ends, scores = step_tensors(self.tokenizer, rollout.completion_ids.cpu(),
                                    rollout.response_mask.cpu(), steps)
        rollout.step_ends, rollout.step_scores = ends, scores  # [N, S]
        self._times["score"] += time.time() - t0

    def process_step_advantages(self, rollout: Rollout, scores: Tensor,
                                metrics: dict[str, float]) -> Tensor:
        """[N, T] outcome advantage of `scores` [N] + process_weight * process advantage."""
        cfg = self.cfg
        self.score_steps(rollout)
        device = rollout.response_mask.device
        step_mask = (rollout.step_ends >= 0).to(device)  # [N, S]
        proc = process_advantages(rollout.step_scores.to(device), step_mask,
                                  rollout.step_ends.to(device), rollout.response_mask,
                                  cfg.group_size, std_ddof=cfg.std_ddof)  # [N, T]
        outcome = group_advantages(scores, cfg.group_size, scale=cfg.scale,
                                   std_ddof=cfg.std_ddof)  # [N]
        adv = outcome[:, None] * rollout.response_mask + cfg.process_weight * proc  # [N, T]
        real = rollout.step_scores.to(device)[step_mask]
        metrics.update({
            "process/steps_mean": float(step_mask.sum(1).float().mean()),
            "process/step_score_mean": float(real.mean()),
            "process/min_step_score_mean": float(
                rollout.step_scores.masked_fill(rollout.step_ends < 0, 1.0).amin(1).mean()),
            "process/advantage_abs_mean": float(masked_mean(proc.abs(), rollout.response_mask)),
        })
        return adv

    def evaluate(self, when: str) -> dict[str, Any]:
        """The base evaluation; with a step scorer the dumps also get each sample's steps,
        step scores and the blamed (lowest-scored) step."""
        out = super().evaluate(when)
        dump = Path(self.cfg.out_dir) / f"eval_{when}.jsonl"
        if self.step_scorer is not None and when != "during" and dump.is_file():
            rows = self.session.eval_rows[: self.cfg.eval_size]
            annotate_dump(dump, self.step_scorer, [r["prompt"] for r in rows])
        return out

    def policy_logprobs(self, rollout: Rollout, model: torch.nn.Module | None = None) -> Tensor:
        """[N, T] no-grad log-probs of the rollout's tokens under `model` (default the policy);
        under FSDP2 only that model's weights are gathered for the pass."""
        model = model if model is not None else self.learner()
        with self.dist.gathered(model):
            return self.forward.batched(model, rollout.prompt_ids, rollout.prompt_mask,
                                        rollout.completion_ids, rollout.attention_mask,
                                        self.cfg.micro_batch_size)

    def loss_mask(self, rollout: Rollout) -> Tensor:
        """[N, T] tokens that count in the loss."""
        mask = rollout.response_mask
        if self.cfg.mask_truncated_completions:
            mask = mask & ~rollout.truncated[:, None]
        if rollout.is_weights is not None:  # rejected by the rollout correction: out
            mask = mask & (rollout.is_weights > 0)
        return mask

    def update(self, rollout: Rollout) -> dict[str, float]:
        """4: num_iterations passes x mini_batches optimizer steps, micro-batched, through the
        one update (`Trainer.update`).

        Loss normalisers cover the whole optimizer step (all its micro-batches, all ranks):
        the tokens and the sequences that count, so a row fully masked (a truncated completion
        under `mask_truncated_completions`) adds to neither.
        """
        cfg = self.cfg
        if self.dist.sum(rollout.num_sequences) == 0:
            return {"train/skipped_empty_batch": 1.0}
        mask_all = self.loss_mask(rollout)  # [N, T]
        if (cfg.rollout_correction() != "none"  # the same test on every rank
                and self.dist.sum(float(mask_all.sum())) == 0):
            return self._all_rejected()
        lengths = mask_all.sum(-1).cpu()  # [N], on the CPU with the index tensors
        plan = local_plan(rollout.num_sequences, cfg.group_size, self.dist,
                          cfg.micro_batch_size, epochs=cfg.num_iterations,
                          mini_batches=cfg.mini_batches, lengths=lengths.tolist(),
                          seed=sequence_seed(cfg.seed, self._step, "update"),
                          micro_batch_tokens=cfg.micro_batch_tokens,
                          widths=row_widths(rollout.prompt_mask, rollout.attention_mask))

        def counts(idx: list[int]) -> dict[str, float]:
            n = lengths[idx]
            return {"tokens": float(n.sum()), "seqs": float((n > 0).sum())}

        def loss_fn(idx: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            m = torch.tensor(idx, dtype=torch.long)
            loss, metrics = self.micro_loss(rollout.select(m), mask_all[m], totals["tokens"],
                                            totals["seqs"])
            return loss, metrics, float(lengths[m].sum())

        return self.optimize(plan, counts, loss_fn)

    def _all_rejected(self) -> dict[str, float]:
        """The rollout correction left no token in the loss: skip the update, say so once."""
        if self.dist.is_main:
            print(all_rejected_warning(
                self.name, self._step, self.cfg, "no update this step. The sampler and the "
                "learner disagree: check the sampler's weights and precision, or raise "
                "rollout_is_cap."), file=sys.stderr)
        return {"train/skipped_empty_batch": 1.0}

    def micro_loss(self, batch: Rollout, mask: Tensor, total_tokens: float,
                   total_seqs: float) -> tuple[Tensor, dict[str, float]]:
        """Forward of one micro-batch: its loss, normalised over the whole optimizer step."""
        cfg = self.cfg
        logprobs, entropy = self.forward.logprobs(
            self.learner(), batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
            batch.attention_mask, with_entropy=True)  # [n, T]; tool tokens read, not trained
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        gap = (old, batch.logprobs, batch.response_mask, cfg.rollout_correction()
               if self._deferred else "none", cfg.rollout_is_cap)
        if self._deferred:  # pi_old / q from this forward (see compute_advantages)
            batch.is_weights = rollout_weights(*gap)[0]
        loss, metrics = policy_loss(
            logprobs, old, batch.advantages, mask, ratio_level=cfg.ratio_level,
            eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high, loss_agg=cfg.loss_agg,
            max_len=cfg.max_new_tokens, sequence_ratio=cfg.sequence_ratio,
            dual_clip=cfg.dual_clip, total_tokens=total_tokens, total_seqs=total_seqs,
            weights=batch.is_weights)
        if batch.is_weights is None or self._deferred:  # the gap (else: at step 3)
            metrics.update(rollout_metrics(*gap))
        out = {k: float(v) for k, v in metrics.items()}
        out["loss/policy"] = float(loss.detach())
        if cfg.kl_coef > 0 and cfg.kl_placement == "loss":
            kl = kl_penalty(logprobs, batch.ref_logprobs, kind=cfg.kl_estimator,
                            clamp=cfg.kl_clamp)  # [n, T]
            kl_loss = aggregate_loss(kl, mask, cfg.loss_agg, max_len=cfg.max_new_tokens,
                                     total_tokens=total_tokens, total_seqs=total_seqs)
            loss = loss + cfg.kl_coef * kl_loss
            out["loss/kl"] = float(cfg.kl_coef * kl_loss.detach())
            out["kl/token_mean"] = float(masked_mean(kl.detach(), mask))
        out["loss/total"] = float(loss.detach())
        if entropy is not None:
            out["policy/entropy"] = float(masked_mean(entropy, mask))
        return loss, out
