"""KTO (Ethayarajh et al. 2024, arXiv:2402.01306) on unpaired rows {prompt, completion, label}.

One step: 1 next batch of rows -> 2 the reference point z0: the policy's log-probs of the
batch's MISMATCHED pairs (each prompt with another row's completion, no gradient) minus the
reference's, averaged over the whole step on every rank, clamped at 0 -> 3 the policy's
log-probs of the rows' own completions and the reference's (precomputed table or on the fly)
-> 4 ``posttrain.ops.kto.kto_loss``, mean over the step's rows, backward per micro-batch, step.

Everything else is the DPO trainer's machinery (rows tokenized as pairs by
``posttrain.data.pairs.tokenize_unpaired``: chosen = own, rejected = mismatched completion;
reference table, micro-batches, resume state, evaluation). Deliberate: the mismatch is a fixed
cycle over the dataset and z0 is averaged over the whole step (TRL 1.16 differs in both).
More: docs/dpo.md, "Module notes", posttrain.trainers.kto.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from posttrain.config.preference import KTOConfig
from posttrain.data.pairs import tokenize_unpaired
from posttrain.engine.update import shard_plan
from posttrain.ops import sequence_logprobs
from posttrain.ops.kto import KTO_LOSSES, kto_loss, kto_reference_point
from posttrain.ops.preference import PreferenceLoss
from posttrain.trainers.dpo import DPOTrainer


class KTOTrainer(DPOTrainer):
    """Kahneman-Tversky optimisation on {prompt, completion, label} rows."""

    name = "kto"
    config_class = KTOConfig
    data_kind = "unpaired"
    progress_keys = ("loss/kto", "rewards/accuracy")
    tokenize = staticmethod(tokenize_unpaired)
    needs = PreferenceLoss(fn=lambda h, beta, s: h)  # summed log-probs and a reference
    cfg: KTOConfig

    def setup(self) -> None:
        self.labels = torch.tensor([bool(r["label"]) for r in self.session.train_rows])  # [M]
        note = weight_note(int(self.labels.sum()), len(self.labels) - int(self.labels.sum()),
                           self.cfg.desirable_weight, self.cfg.undesirable_weight)
        if note and self.dist.is_main:
            print(f"[kto] warning: {note}", file=sys.stderr)
        super().setup()

    def side_logprobs(self, model: torch.nn.Module, idx: Tensor, side: str) -> Tensor:
        """Summed log-probs [n] of the rows ``idx`` with their own completion (``chosen``) or
        their mismatched one (``rejected``)."""
        pairs = self.pairs.select(idx).to(next(model.parameters()).device)
        mask = getattr(pairs, f"{side}_mask")  # [n, T]
        logprobs, _ = self.forward.logprobs(model, pairs.prompt_ids, pairs.prompt_mask,
                                            getattr(pairs, f"{side}_ids"), mask)  # [n, T]
        return sequence_logprobs(logprobs, mask)  # [n]

    @torch.no_grad()
    def mismatched_log_ratio_sum(self, idx: Tensor) -> float:
        """2: sum over the rows ``idx`` of logp - logp_ref of their mismatched pairs."""
        total = 0.0
        for micro in idx.split(self.cfg.micro_batch_size):
            logps = self.side_logprobs(self.learner(), micro, "rejected")  # [n]
            ref = self.reference_logps(self.pairs, micro, "train")[1]  # [n]
            total += float((logps - ref).sum())
        return total

    def update(self, idx: Tensor | list[int]) -> dict[str, float]:
        """One optimizer step over the rows ``idx``: z0 from the step's normalisers (summed over
        every rank), then the loss, the mean over all ranks' rows."""
        cfg = self.cfg
        plan = shard_plan(len(idx), self.dist, cfg.micro_batch_size)
        batch = [int(idx[g]) for g in plan.global_ids]  # this rank's rows
        uses_z0 = KTO_LOSSES[cfg.loss_type][1]  # kto: the reference point; apo: none

        def counts(pos: list[int]) -> dict[str, float]:
            rows = torch.tensor([batch[i] for i in pos], dtype=torch.long)
            kl = self.mismatched_log_ratio_sum(rows) if uses_z0 and pos else 0.0
            return {"rows": float(len(pos)), "kl_sum": kl}

        def loss_fn(pos: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            rows = torch.tensor([batch[i] for i in pos], dtype=torch.long)
            z0 = kto_reference_point(torch.tensor(totals["kl_sum"]), totals["rows"])  # 2, []
            logps = self.side_logprobs(self.learner(), rows, "chosen")  # 3, [n]
            ref = self.reference_logps(self.pairs, rows, "train")[0]  # [n]
            loss, metrics = kto_loss(logps, ref, self.labels[rows].to(logps.device), z0,
                                     beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                                     undesirable_weight=cfg.undesirable_weight,
                                     loss_type=cfg.loss_type)  # 4, [n]
            metrics["loss/kto"] = loss.detach().sum() / totals["rows"]
            metrics["logps/mean"] = logps.detach().mean()
            return loss.sum() / totals["rows"], metrics, float(len(pos))

        out = self.optimize(plan, counts, loss_fn)
        self.ref.updated = True
        return out


def weight_note(n_d: int, n_u: int, w_d: float, w_u: float) -> str | None:
    """The KTO paper's advice (TRL warns likewise): w_d * n_d / (w_u * n_u) in
    [1, 4/3] for n_d desirable and n_u undesirable rows; outside it, the desirable_weight range
    that fits. None when it holds or one kind is absent."""
    if not (n_d and n_u and w_u) or 1.0 <= w_d * n_d / (w_u * n_u) <= 4 / 3:
        return None
    low = w_u * n_u / n_d
    return (f"{n_d} desirable vs {n_u} undesirable rows: desirable_weight * {n_d} / "
            f"(undesirable_weight * {n_u}) = {w_d * n_d / (w_u * n_u):.3g}, outside the KTO "
            f"paper's [1, 4/3]: set desirable_weight in [{low:.3g}, {4 / 3 * low:.3g}] (with "
            f"undesirable_weight {w_u:g})")
