"""DPO and its variants (cDPO, robust DPO, IPO, hinge, SimPO) on preference pairs.

One step: 1 next batch of pairs -> 2 policy sequence log-probs of chosen and rejected (one forward
pass over both) -> 3 reference log-probs (precomputed table or on the fly) -> 4 the loss from
``posttrain.ops.dpo_loss``, backward per micro-batch (normalised over the whole step), clip, step.

Reference: LoRA: the policy with adapters disabled; full fine-tune with ``precompute_ref``: the
policy before its first update (one table, no reference loaded); else a frozen copy of
``cfg.model``. The loss's ``DPO_LOSSES`` entry decides: ``simpo`` needs no reference, ipo /
simpo use token-averaged log-probs. The cache (``posttrain.engine.reference``) stores sums AND
averages, so one cache serves every ``loss_type``. ``rpo_alpha > 0`` adds
``rpo_alpha * NLL(chosen)`` (token-averaged). Completions are ``completion + EOS``; reward
accuracy counts ties as wrong; ``ref_accuracy`` is the reference's own ranking.
More: docs/dpo.md, "Module notes", posttrain.trainers.dpo.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posttrain.config import ConfigError, DPOConfig
from posttrain.data import load_rows
from posttrain.data.pairs import PairTensors, tokenize_pairs
from posttrain.engine.forward import DEFAULT_FORWARD, PolicyForward
from posttrain.engine.reference import ref_cache_path
from posttrain.engine.trainer import Trainer
from posttrain.engine.update import shard_plan
from posttrain.engine.values import completion_values
from posttrain.ops import dpo_loss, sequence_logprobs
from posttrain.ops.preference import DPO_LOSSES, PreferenceLoss

REF_KEYS = ("chosen_sum", "rejected_sum", "chosen_mean", "rejected_mean")


def pair_logprobs(model: torch.nn.Module, pairs: PairTensors,
                  forward: PolicyForward = DEFAULT_FORWARD) -> dict[str, Tensor]:
    """Summed and token-averaged log-probs of chosen and rejected, one forward over both
    (with prompt sharing, each prompt runs once for its two completions).

    Returns {"chosen_sum", "rejected_sum", "chosen_mean", "rejected_mean"}, each [n].
    """
    n = len(pairs)
    pairs = pairs.to(next(model.parameters()).device)
    prompt_ids = torch.cat([pairs.prompt_ids, pairs.prompt_ids])  # [2n, P]
    prompt_mask = torch.cat([pairs.prompt_mask, pairs.prompt_mask])  # [2n, P]
    completion_ids = torch.cat([pairs.chosen_ids, pairs.rejected_ids])  # [2n, T]
    response_mask = torch.cat([pairs.chosen_mask, pairs.rejected_mask])  # [2n, T]
    logprobs, _ = forward.logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                   response_mask)  # [2n, T]
    sums = sequence_logprobs(logprobs, response_mask)  # [2n]
    means = sequence_logprobs(logprobs, response_mask, average=True)  # [2n]
    return {"chosen_sum": sums[:n], "rejected_sum": sums[n:],
            "chosen_mean": means[:n], "rejected_mean": means[n:]}


def preference_loss(cfg: Any, policy: dict[str, Tensor],
                    ref: tuple[Tensor, Tensor] | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO-family loss [n] of ``cfg`` (its ``DPOLossConfig`` keys) on the policy's
    ``pair_logprobs`` and the reference's (chosen, rejected) log-probs (None: reference-free),
    plus RPO's NLL term, with detached metrics. Shared by DPO and online DPO."""
    kind = "mean" if DPO_LOSSES[cfg.loss_type].average else "sum"
    chosen, rejected = policy[f"chosen_{kind}"], policy[f"rejected_{kind}"]  # [n], [n]
    loss, metrics = dpo_loss(chosen, rejected, *(ref or (None, None)), beta=cfg.beta,
                             loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
                             gamma=cfg.simpo_gamma)  # [n]
    if cfg.rpo_alpha > 0:  # RPO: + alpha * NLL of the chosen completion (token mean)
        nll = -policy["chosen_mean"]  # [n]
        loss = loss + cfg.rpo_alpha * nll  # [n]
        metrics["loss/nll_chosen"] = nll.detach().mean()
    metrics["logps/chosen"] = policy["chosen_sum"].detach().mean()
    metrics["logps/rejected"] = policy["rejected_sum"].detach().mean()
    if ref is not None:
        metrics["rewards/ref_accuracy"] = (ref[0] > ref[1]).float().mean()
    return loss, metrics


class DPOTrainer(Trainer):
    """Direct preference optimisation on {prompt, chosen, rejected} rows."""

    name = "dpo"
    supports_bf16_compute = True
    supports_packing = True  # every forward is the one policy forward
    fsdp_meta_start = False  # setup() computes the reference tables with the policy
    config_class = DPOConfig
    run_values = staticmethod(completion_values)
    data_kind = "preferences"
    progress_keys = ("loss/dpo", "rewards/accuracy")
    tokenize = staticmethod(tokenize_pairs)
    """(tokenizer, rows, max_len, source, template) -> PairTensors of the training rows."""
    cfg: DPOConfig

    @property
    def needs(self) -> PreferenceLoss:
        """What the configured loss needs (reference, averaged log-probs, margin)."""
        return DPO_LOSSES[self.cfg.loss_type]

    def validate(self) -> None:
        # held-out pairs are validated before any model loads, like the training rows
        cfg = self.cfg
        if cfg.batch_size % self.dist.world:
            raise ConfigError(f"config key 'batch_size'={cfg.batch_size}: must be a multiple "
                              f"of the {self.dist.world} torchrun processes")
        if getattr(cfg, "simpo_gamma", 0.0) and not self.needs.margin:
            raise ConfigError(f"config key 'simpo_gamma'={cfg.simpo_gamma}: loss_type="
                              f"{cfg.loss_type} takes "
                              "no target margin (simpo does)")
        source = getattr(cfg, "eval_pref_data", "")  # KTO has none
        self.eval_rows = (load_rows(source, kind="preferences", split=cfg.eval_split)
                          if source else [])

    def setup(self) -> None:
        cfg, tok = self.cfg, self.tokenizer
        self.pairs = self.tokenize(tok, self.session.train_rows, cfg.max_seq_len, cfg.train_data,
                                   cfg.chat_template)
        self.eval_pairs = (tokenize_pairs(tok, self.eval_rows, cfg.max_seq_len,
                                          cfg.eval_pref_data, cfg.chat_template)
                           if self.eval_rows else None)
        if cfg.lora_r == 0 and not cfg.precompute_ref and self.needs.reference:
            self.load_reference()
        self.ref.policy_before_update = True  # precompute_ref: the policy before any update
        self.micro_pairs = max(1, cfg.micro_batch_size // 2)  # a pair is two sequences
        self.ref_tables: dict[str, dict[str, Tensor]] = {}
        self.ref_cache: dict[str, str] = {}
        self._implicit_acc: dict[str, float | None] = {}
        # 0. reference log-probs for the whole dataset, once, before any update
        if cfg.precompute_ref and self.needs.reference:
            self.ref_tables["train"] = self.reference_table(self.pairs, cfg.train_data, "train")
            if self.eval_pairs is not None:
                self.ref_tables["eval"] = self.reference_table(self.eval_pairs,
                                                               cfg.eval_pref_data, "eval")

    def step(self, step: int) -> dict[str, float]:
        idx = self.next_indices(self.cfg.batch_size)  # 1 batch of pairs
        return self.update(idx)  # 2 policy, 3 reference, 4 loss + optimizer step

    def evaluate(self, when: str) -> dict[str, Any]:
        """Greedy held-out accuracy (as every trainer) plus held-out implicit-reward metrics."""
        out = super().evaluate(when)
        pref = self.evaluate_pairs()
        self._implicit_acc[when] = pref.get("accuracy")
        out.update({f"pref/{k}": v for k, v in pref.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        # the reference tables are not saved: setup() recomputes them (or reads their cache)
        # from the initial model before the checkpoint's weights are loaded
        return {**super().state_dict(), "updated": self.ref.updated,
                "implicit_acc": dict(self._implicit_acc)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ref.updated = bool(state["updated"])
        self._implicit_acc = dict(state["implicit_acc"])

    def summary_fields(self) -> dict[str, Any]:
        return {"implicit_acc_before": self._implicit_acc.get("before"),
                "implicit_acc_after": self._implicit_acc.get("after"),
                "ref_cache": self.ref_cache}

    def num_train_items(self) -> int:
        return len(self.pairs)  # an epoch is over the tokenized pairs

    # ------------------------------------------------------------------------------------------
    def reference_table(self, pairs: PairTensors, source: str, name: str) -> dict[str, Tensor]:
        """Reference log-probs of every pair (each of REF_KEYS -> [M]), cached on disk."""
        table, self.ref_cache[name] = self.ref.table(
            ref_cache_path(self.cfg, source, pairs, self.model), len(pairs), self.micro_pairs,
            lambda ref, idx: pair_logprobs(ref, pairs.select(idx), self.forward), REF_KEYS,
            {"model": self.cfg.model, "data": source, "pairs": str(len(pairs))})
        return table

    def reference_logps(self, pairs: PairTensors, idx: Tensor, table: str) -> tuple[Tensor, Tensor]:
        """3: reference log-probs [n] of chosen and rejected (table lookup or a forward pass),
        token-averaged where the loss says so."""
        kind = "mean" if self.needs.average else "sum"
        if table in self.ref_tables:
            ref, device = self.ref_tables[table], next(self.model.parameters()).device
            return ref[f"chosen_{kind}"][idx].to(device), ref[f"rejected_{kind}"][idx].to(device)
        with torch.no_grad(), self.reference() as model:
            out = pair_logprobs(model, pairs.select(idx), self.forward)
        return out[f"chosen_{kind}"], out[f"rejected_{kind}"]

    def pair_loss(self, pairs: PairTensors, idx: Tensor,
                  table: str) -> tuple[Tensor, dict[str, Tensor]]:
        """2-4 for the pairs ``idx``: per-pair loss [n] and detached metrics."""
        policy = pair_logprobs(self.learner(), pairs.select(idx), self.forward)  # 2
        ref = self.reference_logps(pairs, idx, table) if self.needs.reference else None  # 3
        return preference_loss(self.cfg, policy, ref)  # 4

    def update(self, idx: Tensor | list[int]) -> dict[str, float]:
        """One optimizer step over the batch ``idx`` through the one update; the loss is the
        mean over the batch (all ranks' pairs), and so are the metrics (pair-weighted)."""
        plan = shard_plan(len(idx), self.dist, self.micro_pairs)
        batch = [int(idx[g]) for g in plan.global_ids]  # this rank's pairs

        def loss_fn(pos: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            loss, metrics = self.pair_loss(self.pairs, torch.tensor([batch[i] for i in pos]),
                                           "train")
            metrics["loss/dpo"] = loss.detach().sum() / totals["pairs"]
            if "loss/nll_chosen" in metrics:  # a share of the batch mean, like every loss/
                metrics["loss/nll_chosen"] = metrics["loss/nll_chosen"] * len(pos) / totals["pairs"]
            return loss.sum() / totals["pairs"], metrics, float(len(pos))

        out = self.optimize(plan, lambda pos: {"pairs": float(len(pos))}, loss_fn)
        self.ref.updated = True
        return out

    @torch.no_grad()
    def evaluate_pairs(self) -> dict[str, float]:
        """Held-out implicit-reward accuracy, margin and loss on ``eval_pref_data``."""
        if self.eval_pairs is None:
            return {}
        was_training = self.model.training
        self.model.eval()
        M, acc = len(self.eval_pairs), {}
        for micro in torch.arange(M).split(self.micro_pairs):
            loss, metrics = self.pair_loss(self.eval_pairs, micro, "eval")
            metrics["loss"] = loss.mean()
            for k, v in metrics.items():
                key = k.split("/")[-1] if k.startswith("rewards/") else k.replace("/", "_")
                acc[key] = acc.get(key, 0.0) + float(v) * len(micro) / M
        self.model.train(was_training)
        return {**acc, "n": M}
