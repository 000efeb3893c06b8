"""Process reward model (PRM): a per-step classifier on step-labelled rows.

Rows ``{"prompt", "steps", "labels"}`` (labels 1 / 0 / -1) are written as
``render(prompt) + s1 + sep + s2 + sep + ...``; the model (``AutoModelForTokenClassification``,
``num_classes`` labels) predicts each step's class at the last token of its separator, and the
loss (``posttrain.ops.prm_step_loss``) counts those positions only (Lightman et al. 2023). With
``soft_labels: true`` the targets are a row's ``soft_labels`` (Math-Shepherd), cross-entropy
against ``(1 - q, q)`` (2 classes only).
One step: 1 next batch of rows -> 2 class logits at every position -> 3 the loss at step ends,
normalised by the steps of the whole optimizer step, backward per micro-batch, clip, step.
Held-out metrics: ``step_accuracy``, ``bad_f1`` / ``bad_precision`` / ``bad_recall``,
``first_error_accuracy``, ``solution_auc``. The step format is saved in config.json
(``posttrain_prm``) for the reward model (``posttrain.models.reward_models``).
More: docs/process_supervision.md, "Module notes", posttrain.trainers.prm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.config import PRMConfig
from posttrain.data import DataError, load_rows, render_prompt, validate_rows
from posttrain.engine.trainer import Trainer
from posttrain.engine.update import shard_plan
from posttrain.engine.values import reward_model_values
from posttrain.models.loading import load_tokenizer
from posttrain.models.reward import (
    PRM_META_KEY,
    build_reward_model,
    encode_steps,
    pad_right,
    token_logits,
)
from posttrain.models.reward_model_metrics import step_metrics
from posttrain.models.reward_models import aggregate_scores
from posttrain.ops import prm_step_loss, step_scores_from_logits


def soft_step_loss(logits: Tensor, targets: Tensor, step_mask: Tensor,
                   total_steps: Tensor | float | None = None) -> Tensor:
    """Cross-entropy against soft targets q = P(good) at step ends (2 classes).

    Args:
        logits: [B, T, 2]; targets: [B, T] q in [0, 1] at step ends; step_mask: [B, T].
    Returns: [] sum over steps of -(q log p_good + (1 - q) log p_bad) / total_steps.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, 2]
    nll = -(targets * logp[..., 1] + (1.0 - targets) * logp[..., 0])  # [B, T]
    mask = step_mask.bool()
    count = mask.sum() if total_steps is None else total_steps
    return torch.where(mask, nll, 0.0).sum() / count  # []


class PRMTrainer(Trainer):
    """Step-level classification training of a process reward model."""

    name = "prm"
    supports_packing = True
    config_class = PRMConfig
    run_values = staticmethod(reward_model_values)
    data_kind = "steps"
    progress_keys = ("loss/prm", "train/step_accuracy")
    cfg: PRMConfig

    def validate(self) -> None:
        """Held-out step rows and soft labels from files, checked before any model loads."""
        for source in (self.cfg.train_data, self.cfg.eval_data):
            if source and Path(source).suffix in (".jsonl", ".json"):
                rows = load_rows(source, "steps")
                if self.cfg.soft_labels and source == self.cfg.train_data:
                    _check_soft(rows, source)

    def load_model(self) -> tuple[Any, Any]:
        cfg = self.cfg
        tok = load_tokenizer(cfg.model)
        return build_reward_model(cfg.model, "prm", tok, num_labels=cfg.num_classes,
                                  dtype=cfg.dtype, dropout=cfg.classifier_dropout), tok

    def setup(self) -> None:
        """A causal LM object becomes a reward model; the step format is recorded; rows
        tokenized."""
        cfg = self.cfg
        if not hasattr(self.model, "score"):  # Python API: a causal LM object
            self.model = build_reward_model(self.model, "prm", self.tokenizer,
                                      num_labels=cfg.num_classes, dropout=cfg.classifier_dropout)
            self.model.to(self.device)
        setattr(self.model.config, PRM_META_KEY, {"separator": cfg.step_separator,
                                                  "split": cfg.step_split})
        rows = validate_rows(enumerate(self.session.train_rows, 1), "steps", cfg.train_data)
        if cfg.soft_labels:
            _check_soft(rows, cfg.train_data)
        self.train_set = self.tokenize(rows, cfg.train_data)
        eval_rows = (validate_rows(enumerate(self.session.eval_rows, 1), "steps", cfg.eval_data)
                     if self.session.eval_rows else [])
        self.eval_set = self.tokenize(eval_rows, cfg.eval_data) if eval_rows else None
        self.last_eval: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
        """Per row: ids, step-end positions, labels (and soft targets)."""
        out = []
        for i, r in enumerate(rows):
            prompt = render_prompt(self.tokenizer, r["prompt"], self.cfg.chat_template)
            ids, ends = encode_steps(self.tokenizer, prompt, r["steps"], self.cfg.step_separator)
            if len(ids) > self.cfg.max_seq_len:
                raise DataError(source, i + 1, "steps", f"prompt + steps is {len(ids)} tokens, "
                                f"over max_seq_len={self.cfg.max_seq_len} (raise it or drop "
                                "the row)")
            out.append({"ids": ids, "ends": ends, "labels": list(r["labels"]),
                        "soft": r.get("soft_labels")})
        return out

    def step_logits(self, data: list[dict[str, Any]], idx: list[int]) -> dict[str, Tensor]:
        """2: logits [n, T, C], labels [n, T], step_mask [n, T] (and soft targets [n, T])."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        items = [data[i] for i in idx]
        ids, mask = pad_right([it["ids"] for it in items], pad)  # [n, T]
        labels = torch.zeros(ids.shape, dtype=torch.long)  # [n, T]
        soft = torch.zeros(ids.shape)  # [n, T]
        step_mask = torch.zeros(ids.shape, dtype=torch.bool)  # [n, T]
        for i, it in enumerate(items):
            ends = torch.tensor(it["ends"], dtype=torch.long)
            labels[i, ends] = torch.tensor(it["labels"], dtype=torch.long)
            step_mask[i, ends] = True
            if it["soft"] is not None:
                soft[i, ends] = torch.tensor(it["soft"], dtype=torch.float)
        with self.autocast():
            logits = token_logits(self.model, ids.to(self.device), mask.to(self.device),
                                  self.cfg.packing)
        return {"logits": logits, "labels": labels.to(self.device),
                "step_mask": step_mask.to(self.device), "soft": soft.to(self.device)}

    def loss(self, out: dict[str, Tensor], total_steps: Tensor | float) -> Tensor:
        """3: step-end loss of one micro-batch, normalised by ``total_steps``."""
        if self.cfg.soft_labels:
            return soft_step_loss(out["logits"], out["soft"], out["step_mask"], total_steps)
        loss, _ = prm_step_loss(out["logits"], out["labels"], out["step_mask"],
                                num_classes=self.cfg.num_classes, total_steps=total_steps)
        return loss

    # ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """One optimizer step over ``batch_size`` rows (1), micro-batched, through the engine;
        the loss is normalised by the steps of the whole batch (all ranks)."""
        cfg = self.cfg
        batch = self.next_indices(cfg.batch_size)  # 1
        plan = shard_plan(len(batch), self.dist, cfg.micro_batch_size)
        idx = [batch[g] for g in plan.global_ids]  # this rank's rows
        self.model.train()

        def counts(pos: list[int]) -> dict[str, float]:
            return {"steps": float(sum(len(self.train_set[idx[i]]["ends"]) for i in pos))}

        def loss_fn(pos: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            out = self.step_logits(self.train_set, [idx[i] for i in pos])  # 2
            loss = self.loss(out, totals["steps"])  # 3
            with torch.no_grad():
                good = step_scores_from_logits(out["logits"]) >= 0.5  # [n, T]
                hit = (good == (out["labels"] != -1))[out["step_mask"]]  # [steps]
            n = float(hit.numel())
            return loss, {"loss/prm": loss.detach(),
                          "train/step_accuracy": float(hit.float().mean()) if n else 0.0}, n

        metrics = self.optimize(plan, counts, loss_fn)
        metrics["train/steps"] = float(sum(len(self.train_set[i]["ends"]) for i in batch))
        return metrics

    @torch.no_grad()
    def predict(self, data: list[dict[str, Any]]) -> list[list[float]]:
        """Step scores P(good) of every row of ``data``."""
        self.model.eval()
        scores: list[list[float]] = []
        for start in range(0, len(data), self.cfg.micro_batch_size):
            idx = list(range(start, min(len(data), start + self.cfg.micro_batch_size)))
            out = self.step_logits(data, idx)
            probs = step_scores_from_logits(out["logits"]).cpu()  # [n, T]
            scores += [probs[k, data[i]["ends"]].tolist() for k, i in enumerate(idx)]
        return scores

    def evaluate(self, when: str) -> dict[str, Any]:
        """Held-out step accuracy (as `accuracy`), bad-step F1, first-error accuracy, AUC."""
        if self.eval_set is None:
            return {}
        was_training = self.model.training
        result = evaluate_step_scores(self.predict(self.eval_set),
                                      [it["labels"] for it in self.eval_set])
        self.model.train(was_training)
        self.last_eval = {"accuracy": result["step_accuracy"], **result}
        return self.last_eval

    def summary_fields(self) -> dict[str, Any]:
        return {k: self.last_eval.get(k) for k in ("bad_f1", "first_error_accuracy",
                                                    "solution_auc")}


def evaluate_step_scores(scores: list[list[float]], labels: list[list[int]],
                         threshold: float = 0.5) -> dict[str, float]:
    """:func:`step_metrics` of step scores (good when >= threshold), + ``min`` solution AUC."""
    agg = aggregate_scores(scores, "min")  # [B]
    return {**step_metrics(scores, labels, threshold, agg), "n": float(len(labels))}


def _check_soft(rows: list[dict[str, Any]], source: str) -> None:
    for i, r in enumerate(rows):
        soft = r.get("soft_labels")
        ok = (isinstance(soft, list) and len(soft) == len(r["steps"])
              and all(isinstance(q, (int, float)) and not isinstance(q, bool) and 0 <= q <= 1
                      for q in soft))
        if not ok:
            raise DataError(source, i + 1, "soft_labels", "expected one number in [0, 1] per "
                            f"step ({len(r['steps'])}) with soft_labels: true, got {soft!r}")
