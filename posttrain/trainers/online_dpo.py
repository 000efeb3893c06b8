"""Online DPO (Guo et al. 2024, arXiv:2402.04792) on a prompt dataset with reward functions,
on the prompt-RL base like GRPO.

One step: 1 sample `group_size` completions per prompt from the current policy (any rollout
engine) -> 2 score them with `rewards` (verifier, ORM, a judge function) -> 3 the best and the
worst of each group form a pair (``posttrain.ops.best_worst_pairs``; a group of ties gives none)
-> 4 the frozen reference's log-probs of the pairs -> 5 the DPO-family loss of the DPO trainer
(``loss_type``, beta, label smoothing, SimPO's margin, RPO), mean over all ranks' pairs, one
optimizer step.

The reference is the starting policy, frozen: a copy (full fine-tune) or the policy with its
LoRA adapters off; a reference-free loss (``simpo``) loads none. Differences from TRL 1.16:
G >= 2 best vs worst, tied groups skipped, truncated completions scored like any other.
More: docs/dpo.md, "Module notes", posttrain.trainers.online_dpo.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import Tensor

from posttrain.config.preference import OnlineDPOConfig
from posttrain.data.pairs import PairTensors
from posttrain.engine.distributed import weighted
from posttrain.engine.update import local_plan
from posttrain.ops.preference import DPO_LOSSES, best_worst_pairs
from posttrain.rollout import Rollout
from posttrain.trainers.dpo import pair_logprobs, preference_loss
from posttrain.trainers.prompt_rl import PromptRLTrainer


def rollout_pairs(rollout: Rollout, chosen: Tensor, rejected: Tensor) -> PairTensors:
    """The rows ``chosen`` [P] and ``rejected`` [P] of a rollout as P preference pairs."""
    return PairTensors(rollout.prompt_ids[chosen], rollout.prompt_mask[chosen],
                       rollout.completion_ids[chosen], rollout.response_mask[chosen],
                       rollout.completion_ids[rejected], rollout.response_mask[rejected])


class OnlineDPOTrainer(PromptRLTrainer):
    """DPO on pairs the policy samples and the rewards rank, step by step."""

    name = "online_dpo"
    supports_bf16_compute = True
    supports_packing = True  # every forward is the one policy forward
    supports_fsdp = False  # ranks holding no pair would skip the sharded reference's passes
    config_class = OnlineDPOConfig
    progress_keys = ("reward/mean", "reward/accuracy", "rewards/accuracy")
    count_metrics = PromptRLTrainer.count_metrics | {"pairs/trained"}
    cfg: OnlineDPOConfig

    def setup(self) -> None:
        if DPO_LOSSES[self.cfg.loss_type].reference:
            self.load_reference()  # a frozen copy (none with LoRA: adapters off)

    def step(self, step: int) -> dict[str, float]:
        cfg, t0 = self.cfg, time.time()
        self._step = step  # sampling seeds: (seed, step, prompt, sample)
        rollout, result, seconds = self.sample_prompts(cfg.prompts_per_step)  # 1, 2
        verdicts = (result.per_function[self.accuracy_from]
                    if self.accuracy_from is not None else None)
        _, metrics = self.reward_metrics(rollout.scores, rollout, verdicts)
        metrics.update(result.metrics)
        chosen, rejected = best_worst_pairs(rollout.scores, cfg.group_size)  # 3, [P], [P]
        pairs = rollout_pairs(rollout, chosen.to(rollout.prompt_ids.device),
                              rejected.to(rollout.prompt_ids.device))
        margin = rollout.scores[chosen] - rollout.scores[rejected]  # [P]
        ref = self.reference_pairs(pairs)  # 4
        t1 = time.time()
        prompts = (chosen // cfg.group_size).tolist()  # this rank's prompt of each pair
        if self.dist.sum(float(len(prompts))) == 0 and self.dist.is_main:  # loud, not silent
            print(f"[{self.name}] warning: step {step}: every group's scores are tied or "
                  "unscorable: no pair, no update (see reward/std)", file=sys.stderr)
        metrics.update(self.update(pairs, ref, prompts))  # 5
        metrics.update(weighted({"pairs/score_margin": float(margin.mean()) if len(prompts)
                                 else 0.0}, len(prompts)))  # a mean over every rank's pairs
        metrics.update({"pairs/trained": float(len(prompts)), "perf/gen_seconds": seconds["gen"],
                        "perf/score_seconds": seconds["score"],
                        "perf/train_seconds": time.time() - t1, "perf/rollout_seconds": t1 - t0})
        return metrics

    @torch.no_grad()
    def reference_pairs(self, pairs: PairTensors) -> dict[str, Tensor] | None:
        """4: the frozen reference's ``pair_logprobs`` of every pair (None: reference-free)."""
        if not DPO_LOSSES[self.cfg.loss_type].reference or len(pairs) == 0:
            return None
        micro = max(1, self.cfg.micro_batch_size // 2)
        parts: dict[str, list[Tensor]] = {}
        with self.reference() as model:
            for idx in torch.arange(len(pairs)).split(micro):
                for k, v in pair_logprobs(model, pairs.select(idx), self.forward).items():
                    parts.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in parts.items()}

    def update(self, pairs: PairTensors, ref: dict[str, Tensor] | None,
               prompts: list[int]) -> dict[str, float]:
        """5: one optimizer step on this rank's pairs (global id: the pair's prompt), the loss
        the mean over every rank's pairs."""
        cfg = self.cfg
        kind = "mean" if DPO_LOSSES[cfg.loss_type].average else "sum"
        plan = local_plan(cfg.prompts_per_step // self.dist.world, 1, self.dist,
                          max(1, cfg.micro_batch_size // 2), rows=prompts)

        def loss_fn(pos: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            idx = torch.tensor(pos, dtype=torch.long)
            policy = pair_logprobs(self.learner(), pairs.select(idx), self.forward)
            pair_ref = (None if ref is None else
                        (ref[f"chosen_{kind}"][idx], ref[f"rejected_{kind}"][idx]))
            loss, metrics = preference_loss(cfg, policy, pair_ref)  # [n]
            metrics["loss/dpo"] = loss.detach().sum() / totals["pairs"]
            if "loss/nll_chosen" in metrics:  # a share of the step's mean, like every loss/
                metrics["loss/nll_chosen"] = metrics["loss/nll_chosen"] * len(pos) / totals["pairs"]
            return loss.sum() / totals["pairs"], metrics, float(len(pos))

        return self.optimize(plan, lambda pos: {"pairs": float(len(pos))}, loss_fn)
