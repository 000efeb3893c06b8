"""Outcome reward model (ORM): a causal LM turned into a scalar scorer.

The model is ``AutoModelForSequenceClassification`` with one label on the policy's decoder (see
``posttrain.models.reward`` for why); the score is read at the last real token of
``render(prompt) + completion + EOS``. Two objectives (``docs/reward_models.md``):

* ``bradley_terry`` on preference rows ``{"prompt", "chosen", "rejected"}``:
  ``-log sigmoid(r_w - r_l - m)`` (``posttrain.ops.bradley_terry_loss``; Ouyang et al. 2022,
  arXiv:2203.02155). ``m`` is ``margin`` plus a row's own ``margin`` field when present
  (the Llama-2 variant, Touvron et al. 2023, arXiv:2307.09288).
* ``binary`` on outcome rows ``{"prompt", "completion", "label": 1 | 0}``: binary cross-entropy
  of ``sigmoid(r)`` against the label, what "Let's Verify Step by Step" (Lightman et al. 2023,
  arXiv:2305.20050) trains its ORM on.

One step: 1 next batch of rows -> 2 scores at the last real token (one forward over chosen and
rejected together) -> 3 the loss, backward per micro-batch normalised over the whole step,
clip, step. Held-out metrics (``eval_data``, same kind as ``train_data``): pair accuracy (ties
count as wrong), ROC AUC (chosen = positive, rejected = negative; or label vs score), margin,
score mean/std of chosen and rejected (positives and negatives), loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.config import BaseConfig, ConfigError
from posttrain.data import DataError, load_rows, render_prompt
from posttrain.models.loading import load_tokenizer
from posttrain.models.reward import build_scorer, pad_right, sequence_scores
from posttrain.ops import bradley_terry_loss
from posttrain.rollout import autocast_ctx
from posttrain.trainers.common import (
    MetricsLogger,
    build_optimizer,
    clip_and_step,
    peak_rss_mb,
    save_checkpoint,
    save_config,
    set_seed,
    setup_threads,
    write_summary,
)
from posttrain.trainers.session import resolve_device

KIND = {"bradley_terry": "preferences", "binary": "outcomes"}


@dataclass
class RMConfig(BaseConfig):
    train_data: str = ""
    """Preference rows {"prompt", "chosen", "rejected"} (bradley_terry) or outcome rows
    {"prompt", "completion", "label": 1|0} (binary); JSONL path or `datasets` name."""
    train_split: str = "train"
    """Split name when `train_data` is a `datasets` name."""
    eval_data: str = ""
    """Held-out rows of the same kind as `train_data`; empty: no held-out evaluation."""
    objective: Literal["bradley_terry", "binary"] = "bradley_terry"
    """Bradley-Terry on preference pairs, or binary correctness on single completions."""
    margin: float = 0.0
    """Bradley-Terry margin m in -log sigmoid(r_w - r_l - m), added to a row's `margin` field."""
    batch_size: int = 32
    """Pairs (or completions) per optimizer step."""
    micro_batch_size: int = 32
    """Pairs (or completions) per forward/backward (gradient accumulation)."""
    max_len: int = 256
    """Longest prompt+completion in tokens; longer rows are an error."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties count 1/2.

    Args: scores [N]; labels [N] bool (True = positive). Returns nan without both classes.
    """
    pos, neg = scores[labels.bool()], scores[~labels.bool()]  # [P], [Q]
    if pos.numel() == 0 or neg.numel() == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]  # [P, Q]
    return float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())


def encode(tokenizer: Any, rows: list[dict[str, Any]], field: str, max_len: int,
           source: str) -> list[list[int]]:
    """Token ids of ``render(prompt) + row[field] + EOS``; rows over max_len raise DataError."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    texts = [render_prompt(tokenizer, r["prompt"]) + r[field] for r in rows]
    seqs = [ids + eos for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    for i, ids in enumerate(seqs):
        if len(ids) > max_len:
            raise DataError(source, i + 1, field, f"prompt + {field} is {len(ids)} tokens, over "
                            f"max_len={max_len} (raise max_len or drop the row)")
    return seqs


class RewardModelTrainer:
    """Bradley-Terry or binary-correctness training of a scalar scorer."""

    name = "rm"

    def __init__(self, cfg: RMConfig, *, model: Any = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        validate(cfg)
        setup_threads(cfg.threads)
        self.gen = set_seed(cfg.seed)
        kind = KIND[cfg.objective]
        # rows are validated before the tokenizer or any model loads
        self.train_rows = load_rows(cfg.train_data, kind, split=cfg.train_split,
                                    subset=cfg.data_subset or None, columns=cfg.columns or None)
        self.eval_rows = (load_rows(cfg.eval_data, kind, split=cfg.eval_split,
                                    limit=cfg.eval_size) if cfg.eval_data else [])
        _check_margins(self.train_rows, cfg.train_data)
        self.tokenizer = tokenizer or load_tokenizer(cfg.model)
        self.train_set = self.tokenize(self.train_rows, cfg.train_data)
        self.eval_set = self.tokenize(self.eval_rows, cfg.eval_data) if self.eval_rows else None
        self.device = resolve_device(cfg.device)
        self.model = build_scorer(model if model is not None else cfg.model, "orm",
                                  self.tokenizer, num_labels=1, dtype=cfg.dtype).to(self.device)
        self.opt, self.sched = build_optimizer(self.model, cfg, cfg.max_steps)
        self._order: list[int] = []

    # ------------------------------------------------------------------------------------------
    def tokenize(self, rows: list[dict[str, Any]], source: str) -> dict[str, Any]:
        cfg, tok = self.cfg, self.tokenizer
        if cfg.objective == "binary":
            return {"seqs": encode(tok, rows, "completion", cfg.max_len, source),
                    "labels": torch.tensor([float(r["label"]) for r in rows])}
        for i, r in enumerate(rows):
            if r["chosen"] == r["rejected"]:
                raise DataError(source, i + 1, "rejected", "identical to 'chosen'; a preference "
                                "pair needs two different completions")
        return {"chosen": encode(tok, rows, "chosen", cfg.max_len, source),
                "rejected": encode(tok, rows, "rejected", cfg.max_len, source),
                "margin": torch.tensor([float(r.get("margin", 0.0)) + cfg.margin for r in rows])}

    def scores(self, data: dict[str, Any], idx: list[int]) -> dict[str, Tensor]:
        """2: scores of rows ``idx``: {"chosen", "rejected"} [n] each, or {"score"} [n]."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if self.cfg.objective == "binary":
            seqs = [data["seqs"][i] for i in idx]
        else:
            seqs = [data["chosen"][i] for i in idx] + [data["rejected"][i] for i in idx]
        ids, mask = pad_right(seqs, pad)  # [n or 2n, T]
        with autocast_ctx(self.cfg.autocast_bf16, self.device):
            r = sequence_scores(self.model, ids.to(self.device), mask.to(self.device))
        if self.cfg.objective == "binary":
            return {"score": r}
        return {"chosen": r[:len(idx)], "rejected": r[len(idx):]}

    def loss(self, data: dict[str, Any], idx: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
        """2-3 for rows ``idx``: mean loss [] and detached per-row values."""
        s = self.scores(data, idx)
        if self.cfg.objective == "binary":
            labels = data["labels"][idx].to(self.device)  # [n]
            loss = F.binary_cross_entropy_with_logits(s["score"], labels)
            return loss, {"score": s["score"].detach(), "label": labels}
        margin = data["margin"][idx].to(self.device)  # [n]
        use_margin = margin if bool(margin.any()) else None
        loss = bradley_terry_loss(s["chosen"], s["rejected"], use_margin)
        return loss, {"chosen": s["chosen"].detach(), "rejected": s["rejected"].detach()}

    # ------------------------------------------------------------------------------------------
    def next_indices(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = torch.randperm(len(self.train_rows), generator=self.gen).tolist()
            out.append(self._order.pop())
        return out

    def step(self, step: int) -> dict[str, float]:
        """One optimizer step over ``batch_size`` rows, micro-batched."""
        cfg = self.cfg
        idx = self.next_indices(cfg.batch_size)  # 1
        self.model.train()
        parts: list[dict[str, Tensor]] = []
        total = 0.0
        for start in range(0, len(idx), cfg.micro_batch_size):
            micro = idx[start:start + cfg.micro_batch_size]
            loss, values = self.loss(self.train_set, micro)  # 2-3
            (loss * len(micro) / len(idx)).backward()
            total += float(loss.detach()) * len(micro) / len(idx)
            parts.append(values)
        metrics = {f"train/{k}": v for k, v in summarize(parts, self.cfg.objective).items()}
        metrics["loss/rm"] = total
        metrics["train/grad_norm"] = float(clip_and_step(self.model, self.opt, self.sched,
                                                         cfg.max_grad_norm))
        metrics["train/lr"] = self.sched.get_last_lr()[0]
        return metrics

    @torch.no_grad()
    def evaluate(self, when: str = "after") -> dict[str, float]:
        """Held-out pair accuracy / AUC / margin / score statistics / loss."""
        if self.eval_set is None:
            return {}
        self.model.eval()
        n = len(self.eval_rows)
        parts, total = [], 0.0
        for start in range(0, n, self.cfg.micro_batch_size):
            idx = list(range(start, min(n, start + self.cfg.micro_batch_size)))
            loss, values = self.loss(self.eval_set, idx)
            total += float(loss) * len(idx) / n
            parts.append(values)
        return {**summarize(parts, self.cfg.objective), "loss": total, "n": float(n)}

    def save(self, path: str | Path) -> None:
        save_checkpoint(self.model, self.tokenizer, path)

    # ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        return train_loop(self, "accuracy")


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


def train_loop(trainer: Any, headline: str) -> dict[str, Any]:
    """Eval before -> ``max_steps`` steps (log, eval, checkpoint cadence) -> eval after, save,
    summary.json. Shared by the ORM and PRM trainers."""
    cfg, start = trainer.cfg, time.time()
    save_config(cfg.out_dir, cfg)
    logger = MetricsLogger(cfg.out_dir)
    before = trainer.evaluate("before")
    logger.log(0, {f"eval/{k}": v for k, v in before.items()})
    history = []
    for step in range(1, cfg.max_steps + 1):
        t0 = time.time()
        metrics = trainer.step(step)
        metrics["perf/step_seconds"] = time.time() - t0
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
            metrics.update({f"eval/{k}": v for k, v in trainer.evaluate("during").items()})
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            history.append({"step": step, **logger.log(step, metrics)})
        if cfg.save_every and step % cfg.save_every == 0:
            trainer.save(Path(cfg.out_dir) / "checkpoint")
    after = trainer.evaluate("after")
    logger.log(cfg.max_steps, {f"eval/{k}": v for k, v in after.items()})
    logger.close()
    trainer.save(Path(cfg.out_dir) / "final")
    summary = {"eval_before": before.get(headline), "eval_after": after.get(headline),
               "eval_before_detail": before, "eval_after_detail": after,
               "seconds": round(time.time() - start, 1), "steps": cfg.max_steps,
               "peak_rss_mb": round(peak_rss_mb(), 1), "history": history}
    write_summary(cfg.out_dir, cfg, **summary)
    return summary


def _check_margins(rows: list[dict[str, Any]], source: str) -> None:
    for i, r in enumerate(rows):
        m = r.get("margin", 0.0)
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise DataError(source, i + 1, "margin", f"expected a number, got {m!r}")


def validate(cfg: Any) -> None:
    """Cross-field checks shared by the ORM and PRM configs (ConfigError names the key)."""
    if not cfg.train_data:
        raise ConfigError("config key 'train_data': required")
    checks = {
        "batch_size": (cfg.batch_size >= 1, "expected >= 1"),
        "micro_batch_size": (cfg.micro_batch_size >= 1, "expected >= 1"),
        "max_len": (cfg.max_len >= 2, "expected >= 2"),
        "lora_r": (cfg.lora_r == 0, "LoRA is not supported for reward models yet; use 0"),
    }
    for key, (ok, msg) in checks.items():
        if not ok:
            raise ConfigError(f"config key '{key}'={getattr(cfg, key)!r}: {msg}")
