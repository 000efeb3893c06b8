"""Outcome reward model (ORM): a causal LM turned into a scalar reward model.

``AutoModelForSequenceClassification`` (one label) on the policy's decoder; the score is read at
the last real token of ``render(prompt) + completion + turn end`` (one end token, `closed_ids`).
Two objectives (``docs/reward_models.md``):
* ``bradley_terry`` on ``{"prompt", "chosen", "rejected"}``: ``-log sigmoid(r_w - r_l - m)``,
  ``m`` = ``margin`` plus a row's own ``margin`` field (Llama-2's variant).
* ``binary`` on ``{"prompt", "completion", "label": 1 | 0}``: BCE of ``sigmoid(r)``; with
  ``token_level: true`` at every completion token (the score is still the last token's).
One step: 1 next batch of rows -> 2 scores at the last real token (one forward over chosen and
rejected together) -> 3 the loss, backward per micro-batch normalised over the whole step,
clip, step. Held-out metrics: pair accuracy (ties wrong), ROC AUC, margin, score mean/std of
each side, loss.
More: docs/reward_models.md, "Module notes", posttrain.trainers.reward_model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.config import RMConfig
from posttrain.data import DataError, load_rows, render_prompt, validate_rows
from posttrain.data.prompts import TemplateError, closed_ids, render_completion
from posttrain.engine.trainer import Trainer
from posttrain.engine.update import shard_plan
from posttrain.engine.values import reward_model_values
from posttrain.models.loading import load_tokenizer
from posttrain.models.reward import (
    build_reward_model,
    last_positions,
    pad_right,
    position_scores,
    sequence_scores,
)
from posttrain.models.reward_model_metrics import roc_auc
from posttrain.ops import bradley_terry_loss, token_outcome_loss

KIND = {"bradley_terry": "preferences", "binary": "outcomes"}


def encode(tokenizer: Any, rows: list[dict[str, Any]], field: str, max_len: int,
           source: str, template: str = "auto") -> list[list[int]]:
    """Token ids of ``render(prompt) + row[field]`` ending at one turn-end token
    (`posttrain.data.prompts.closed_ids`; a conversational side rendered by the chat template);
    rows over max_len raise DataError."""
    texts = []
    for i, r in enumerate(rows):
        try:
            texts.append(render_completion(tokenizer, r["prompt"], r[field], template))
        except TemplateError as err:
            raise DataError(source, i + 1, field, str(err)) from err
    seqs = closed_ids(tokenizer, [p for p, _ in texts], [c for _, c in texts],
                      [isinstance(r[field], list) for r in rows], template)
    for i, ids in enumerate(seqs):
        if len(ids) > max_len:
            raise DataError(source, i + 1, field, f"prompt + {field} is {len(ids)} tokens, over "
                            f"max_seq_len={max_len} (raise it or drop the row)")
    return seqs


def completion_starts(tokenizer: Any, rows: list[dict[str, Any]],
                      seqs: list[list[int]], template: str = "auto") -> list[int]:
    """Index of each sequence's first completion token: the length of the common prefix of the
    rendered prompt's own ids and the sequence (exact even when a tokenizer merges across the
    prompt/completion boundary: the merged token counts as completion)."""
    texts = [render_prompt(tokenizer, r["prompt"], template) for r in rows]
    starts = []
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for prompt_ids, ids in zip(prompts, seqs, strict=True):
        n = 0
        while n < min(len(prompt_ids), len(ids) - 1) and prompt_ids[n] == ids[n]:
            n += 1
        starts.append(n)
    return starts


class RewardModelTrainer(Trainer):
    """Bradley-Terry or binary-correctness training of a scalar reward model."""

    name = "rm"
    config_class = RMConfig
    run_values = staticmethod(reward_model_values)
    progress_keys = ("loss/rm", "train/accuracy")
    supports_fsdp = False  # scores are read from the decoder under the root module's group
    supports_packing = True
    cfg: RMConfig

    @property
    def data_kind(self) -> str:  # type: ignore[override]
        return KIND[self.cfg.objective]

    def validate(self) -> None:
        """Row checks beyond the schema (margins; held-out rows of the train kind) from files,
        before any model loads; in-memory rows are checked again in `setup`."""
        self.eval_source = self.cfg.eval_data
        for source in (self.cfg.train_data, self.eval_source):
            if source and Path(source).suffix in (".jsonl", ".json"):
                _check_margins(load_rows(source, self.data_kind), source)

    def load_model(self) -> tuple[Any, Any]:
        tok = load_tokenizer(self.cfg.model)
        return build_reward_model(self.cfg.model, "orm", tok, num_labels=1,
                                  dtype=self.cfg.dtype), tok

    def setup(self) -> None:
        """A causal LM object becomes a reward model; rows are checked and tokenized."""
        cfg = self.cfg
        if not hasattr(self.model, "score"):  # Python API: a causal LM object
            self.model = build_reward_model(self.model, "orm", self.tokenizer, num_labels=1)
            self.model.to(self.device)
        rows = validate_rows(enumerate(self.session.train_rows, 1), self.data_kind, cfg.train_data)
        _check_margins(rows, cfg.train_data)
        self.train_set = self.tokenize(rows, cfg.train_data)
        self.eval_rows = (validate_rows(enumerate(self.session.eval_rows, 1), self.data_kind,
                                        self.eval_source) if self.session.eval_rows else [])
        self.eval_set = self.tokenize(self.eval_rows, cfg.eval_data) if self.eval_rows else None
        self.last_eval: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict[str, Any]], source: str) -> dict[str, Any]:
        cfg, tok = self.cfg, self.tokenizer
        if cfg.objective == "binary":
            seqs = encode(tok, rows, "completion", cfg.max_seq_len, source, cfg.chat_template)
            return {"seqs": seqs, "labels": torch.tensor([float(r["label"]) for r in rows]),
                    "starts": torch.tensor(completion_starts(tok, rows, seqs,
                                                             cfg.chat_template))}
        for i, r in enumerate(rows):
            if r["chosen"] == r["rejected"]:
                raise DataError(source, i + 1, "rejected", "identical to 'chosen'; a preference "
                                "pair needs two different completions")
        return {"chosen": encode(tok, rows, "chosen", cfg.max_seq_len, source, cfg.chat_template),
                "rejected": encode(tok, rows, "rejected", cfg.max_seq_len, source,
                                   cfg.chat_template),
                "margin": torch.tensor([float(r.get("margin", 0.0)) + cfg.margin for r in rows])}

    def rows_per_micro(self) -> int:
        """Rows per forward: a pair is two sequences."""
        per_row = 1 if self.cfg.objective == "binary" else 2
        return max(1, self.cfg.micro_batch_size // per_row)

    def scores(self, data: dict[str, Any], idx: list[int]) -> dict[str, Tensor]:
        """2: scores of rows ``idx``: {"chosen", "rejected"} [n] each, or {"score"} [n] (with
        ``token_level``, also {"positions"} [n, T] and the completion mask {"response_mask"})."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.cfg.objective == "binary":
            seqs = [data["seqs"][i] for i in idx]
        else:
            seqs = [data["chosen"][i] for i in idx] + [data["rejected"][i] for i in idx]
        ids, mask = pad_right(seqs, pad)  # [n or 2n, T]
        if self.cfg.token_level:
            with self.autocast():
                per_pos = position_scores(self.model, ids.to(self.device), mask.to(self.device),
                                          self.cfg.packing)
            mask = mask.to(self.device)
            last = last_positions(mask)  # [n]
            cols = torch.arange(mask.shape[1], device=self.device)[None, :]  # [1, T]
            starts = data["starts"][idx].to(self.device)[:, None]  # [n, 1]
            return {"score": per_pos[torch.arange(len(idx), device=self.device), last],
                    "positions": per_pos, "response_mask": mask & (cols >= starts)}
        with self.autocast():
            r = sequence_scores(self.model, ids.to(self.device), mask.to(self.device),
                                self.cfg.packing)
        if self.cfg.objective == "binary":
            return {"score": r}
        return {"chosen": r[:len(idx)], "rejected": r[len(idx):]}

    def loss(self, data: dict[str, Any], idx: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
        """2-3 for rows ``idx``: mean loss [] and detached per-row values."""
        s = self.scores(data, idx)
        if self.cfg.objective == "binary":
            labels = data["labels"][idx].to(self.device)  # [n]
            if self.cfg.token_level:
                loss = token_outcome_loss(s["positions"], labels, s["response_mask"])
            else:
                loss = F.binary_cross_entropy_with_logits(s["score"], labels)
            return loss, {"score": s["score"].detach(), "label": labels}
        margin = data["margin"][idx].to(self.device)  # [n]
        use_margin = margin if bool(margin.any()) else None
        loss = bradley_terry_loss(s["chosen"], s["rejected"], use_margin)
        return loss, {"chosen": s["chosen"].detach(), "rejected": s["rejected"].detach()}

    # ------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """One optimizer step over ``batch_size`` rows (1), micro-batched, through the engine;
        the loss is the mean over the batch (all ranks' rows); accuracy and AUC are computed
        over the whole batch's rows, gathered from every rank."""
        batch = self.next_indices(self.cfg.batch_size)  # 1
        plan = shard_plan(len(batch), self.dist, self.rows_per_micro())
        idx = [batch[g] for g in plan.global_ids]  # this rank's rows
        self.model.train()
        parts: list[dict[str, Tensor]] = []

        def loss_fn(pos: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            loss, values = self.loss(self.train_set, [idx[i] for i in pos])  # 2-3
            parts.append({k: v.cpu() for k, v in values.items()})
            share = loss * len(pos) / totals["rows"]  # this micro-batch's share of the mean
            return share, {"loss/rm": share.detach()}, float(len(pos))

        metrics = self.optimize(plan, lambda pos: {"rows": float(len(pos))}, loss_fn)
        every = [p for rank in self.dist.all_gather_objects(parts) for p in rank]
        metrics.update({f"train/{k}": v for k, v in summarize(every, self.cfg.objective).items()})
        return metrics

    @torch.no_grad()
    def evaluate(self, when: str) -> dict[str, Any]:
        """Held-out pair accuracy / AUC / margin / score statistics / loss."""
        if self.eval_set is None:
            return {}
        was_training = self.model.training
        self.model.eval()
        n, per = len(self.eval_rows), self.rows_per_micro()
        parts, total = [], 0.0
        for start in range(0, n, per):
            idx = list(range(start, min(n, start + per)))
            loss, values = self.loss(self.eval_set, idx)
            total += float(loss) * len(idx) / n
            parts.append(values)
        self.model.train(was_training)
        self.last_eval = {**summarize(parts, self.cfg.objective), "loss": total, "n": float(n)}
        return self.last_eval

    def summary_fields(self) -> dict[str, Any]:
        return {"pair_accuracy" if self.cfg.objective == "bradley_terry" else "outcome_accuracy":
                self.last_eval.get("accuracy"), "auc": self.last_eval.get("auc")}


def summarize(parts: list[dict[str, Tensor]], objective: str) -> dict[str, float]:
    """Accuracy, AUC, margin and score statistics of concatenated per-row values."""
    cat = {k: torch.cat([p[k] for p in parts]).float().cpu() for k in parts[0]}
    if objective == "binary":
        score, label = cat["score"], cat["label"].bool()
        pos, neg = score[label], score[~label]
        return {"accuracy": float(((score > 0) == label).float().mean()),
                "auc": roc_auc(score, label),
                "margin": float(pos.mean() - neg.mean()) if len(pos) and len(neg) else float("nan"),
                **_stats(pos, "positive"), **_stats(neg, "negative")}
    chosen, rejected = cat["chosen"], cat["rejected"]
    both = torch.cat([chosen, rejected])
    labels = torch.cat([torch.ones_like(chosen), torch.zeros_like(rejected)]).bool()
    return {"accuracy": float((chosen > rejected).float().mean()), "auc": roc_auc(both, labels),
            "margin": float((chosen - rejected).mean()),
            **_stats(chosen, "chosen"), **_stats(rejected, "rejected")}


def _stats(x: Tensor, name: str) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    return {f"{name}_mean": float(x.mean()),
            f"{name}_std": float(x.std(unbiased=False))}


def _check_margins(rows: list[dict[str, Any]], source: str) -> None:
    for i, r in enumerate(rows):
        m = r.get("margin", 0.0)
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise DataError(source, i + 1, "margin", f"expected a number, got {m!r}")
