"""DPO and its variants (cDPO, robust DPO, IPO, hinge) on preference pairs.

One step: 1 next batch of pairs -> 2 policy sequence log-probs of chosen and rejected (one forward
pass over both) -> 3 reference log-probs (precomputed table or on the fly) -> 4 the loss from
``posttrain.ops.dpo_loss``, backward per micro-batch (normalised over the whole step), clip, step.

Where the reference comes from:
- LoRA (``lora_r > 0``): the policy itself with its adapters disabled; no second copy.
- Full fine-tune with ``precompute_ref``: the policy before its first update IS the reference, so
  the table for the whole dataset is computed with it once and no reference model is loaded.
- Full fine-tune without ``precompute_ref``: a frozen copy loaded from ``cfg.model``.

Reference cache: ``<data file>.refcache/<key>.safetensors`` (under ``out_dir/refcache`` for a
``datasets`` name) holding per-pair summed AND token-averaged log-probs of chosen and rejected.
The key hashes the model (path, config.json, weight files' names/sizes/mtimes), the tokenized
pairs (so any change of data, tokenizer or chat template invalidates it), dtype and
autocast. Deliberate difference from keying on the loss type: both sums (DPO) and averages (IPO)
are stored, so one cache serves every ``loss_type``.

Optional RPO term (``rpo_alpha > 0``, Pang et al. 2024): each pair's loss gets
``rpo_alpha * NLL(chosen)`` with the NLL averaged over the chosen tokens, as in SFT.

Other choices: completions are tokenized as ``completion + EOS`` (as SFT trains them); implicit
reward accuracy counts ties as wrong (so it is 0 before training, when policy == reference), and
``ref_accuracy`` reports the reference's own ranking ``logp_ref(y_w) > logp_ref(y_l)`` as a
baseline.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from posttrain.config import ConfigError, DPOConfig
from posttrain.data import DataError, load_rows, render_prompt
from posttrain.models import adapters_disabled
from posttrain.ops import dpo_loss, sequence_logprobs
from posttrain.trainers.common import (
    MetricsLogger,
    build_optimizer,
    clip_and_step,
    merged,
    peak_rss_mb,
    save_checkpoint,
    save_config,
    set_seed,
    setup_threads,
    write_summary,
)
from posttrain.trainers.forward import completion_logprobs
from posttrain.trainers.session import Session, load_session

REF_KEYS = ("chosen_sum", "rejected_sum", "chosen_mean", "rejected_mean")


@dataclass
class PairTensors:
    """M tokenized pairs: prompt [M, P] left padded; chosen / rejected [M, T] right padded."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    chosen_ids: Tensor
    chosen_mask: Tensor
    rejected_ids: Tensor
    rejected_mask: Tensor

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, idx: Tensor) -> PairTensors:
        return PairTensors(*(getattr(self, f.name)[idx] for f in fields(self)))

    def to(self, device: torch.device) -> PairTensors:
        return PairTensors(*(getattr(self, f.name).to(device) for f in fields(self)))

    def digest(self) -> str:
        h = hashlib.sha256()
        for f in fields(self):
            t = getattr(self, f.name)
            h.update(f"{f.name}{tuple(t.shape)}".encode())
            h.update(t.to(torch.int64).numpy().tobytes())
        return h.hexdigest()


def tokenize_pairs(tokenizer: Any, rows: list[dict[str, Any]], max_len: int,
                   source: str) -> PairTensors:
    """Chat-template the prompts and tokenize ``completion + EOS``; bad rows raise DataError."""
    prompts = [render_prompt(tokenizer, r["prompt"]) for r in rows]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer([r["chosen"] for r in rows], add_special_tokens=False)["input_ids"]
    r_ids = tokenizer([r["rejected"] for r in rows], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for i, (row, p, c, r) in enumerate(zip(rows, p_ids, c_ids, r_ids, strict=True)):
        if row["chosen"] == row["rejected"]:
            raise DataError(source, i + 1, "rejected", "identical to 'chosen'; a preference "
                            "pair needs two different completions")
        for name, comp in (("chosen", c), ("rejected", r)):
            if not comp + eos:
                raise DataError(source, i + 1, name, "empty, and the tokenizer has no EOS token")
            if len(p) + len(comp) + len(eos) > max_len:
                raise DataError(source, i + 1, name, f"prompt + {name} is "
                                f"{len(p) + len(comp) + len(eos)} tokens, over max_len={max_len} "
                                "(raise max_len or drop the row)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    P = max(len(p) for p in p_ids)
    T = max(len(x) + len(eos) for x in c_ids + r_ids)
    M = len(rows)
    prompt_ids = torch.full((M, P), pad, dtype=torch.long)  # [M, P]
    prompt_mask = torch.zeros((M, P), dtype=torch.bool)  # [M, P]
    comp = {k: torch.full((M, T), pad, dtype=torch.long) for k in ("chosen", "rejected")}
    mask = {k: torch.zeros((M, T), dtype=torch.bool) for k in ("chosen", "rejected")}
    for i, p in enumerate(p_ids):
        prompt_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, P - len(p):] = True
        for k, ids in (("chosen", c_ids[i] + eos), ("rejected", r_ids[i] + eos)):
            comp[k][i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[k][i, : len(ids)] = True
    return PairTensors(prompt_ids, prompt_mask, comp["chosen"], mask["chosen"],
                       comp["rejected"], mask["rejected"])


def pair_logprobs(model: torch.nn.Module, pairs: PairTensors,
                  autocast: bool = False) -> dict[str, Tensor]:
    """Summed and token-averaged log-probs of chosen and rejected, one forward over both.

    Returns {"chosen_sum", "rejected_sum", "chosen_mean", "rejected_mean"}, each [n].
    """
    n = len(pairs)
    pairs = pairs.to(next(model.parameters()).device)
    prompt_ids = torch.cat([pairs.prompt_ids, pairs.prompt_ids])  # [2n, P]
    prompt_mask = torch.cat([pairs.prompt_mask, pairs.prompt_mask])  # [2n, P]
    completion_ids = torch.cat([pairs.chosen_ids, pairs.rejected_ids])  # [2n, T]
    response_mask = torch.cat([pairs.chosen_mask, pairs.rejected_mask])  # [2n, T]
    logprobs, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                      response_mask, 1.0, autocast)  # [2n, T]
    sums = sequence_logprobs(logprobs, response_mask)  # [2n]
    means = sequence_logprobs(logprobs, response_mask, average=True)  # [2n]
    return {"chosen_sum": sums[:n], "rejected_sum": sums[n:],
            "chosen_mean": means[:n], "rejected_mean": means[n:]}


def model_fingerprint(model: str) -> str:
    """Path + config.json + weight files' names/sizes/mtimes (a Hub name: the name itself)."""
    path = Path(model)
    if not path.is_dir():
        return model
    parts = [str(path.resolve())]
    if (path / "config.json").is_file():
        parts.append((path / "config.json").read_text())
    for f in sorted(path.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt"):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def ref_cache_path(cfg: DPOConfig, source: str, pairs: PairTensors) -> Path:
    """Where the reference table of ``pairs`` (loaded from ``source``) is cached."""
    h = hashlib.sha256()
    for part in (model_fingerprint(cfg.model), cfg.dtype, str(cfg.autocast_bf16), pairs.digest()):
        h.update(part.encode())
        h.update(b"\0")
    src = Path(source)
    folder = (src.parent / f"{src.name}.refcache" if src.is_file()
              else Path(cfg.out_dir) / "refcache")
    return folder / f"{h.hexdigest()[:32]}.safetensors"


class DPOTrainer:
    """Direct preference optimisation on {prompt, chosen, rejected} rows."""

    def __init__(self, cfg: DPOConfig, session: Session | None = None) -> None:
        self.cfg = cfg
        _validate(cfg)
        setup_threads(cfg.threads)
        self.gen = set_seed(cfg.seed)
        # Held-out pairs, data and rewards are validated before any model is loaded.
        eval_rows = (load_rows(cfg.eval_pref_data, kind="preferences", split=cfg.eval_split)
                     if cfg.eval_pref_data else [])
        self.s = session or load_session(cfg, kind="preferences")
        self.tok = self.s.tokenizer
        self.pairs = tokenize_pairs(self.tok, self.s.train_rows, cfg.max_len, cfg.train_data)
        self.eval_pairs = (tokenize_pairs(self.tok, eval_rows, cfg.max_len, cfg.eval_pref_data)
                           if eval_rows else None)
        self.s.maybe_lora()
        self.model = self.s.model
        self.ref = (self.s.load_reference()
                    if cfg.lora_r == 0 and not cfg.precompute_ref else None)
        self.opt, self.sched = build_optimizer(self.model, cfg, cfg.max_steps)
        self.logger = MetricsLogger(cfg.out_dir)
        self.ref_tables: dict[str, dict[str, Tensor]] = {}
        self.ref_cache: dict[str, str] = {}
        self._order: list[int] = []
        self._updated = False

    # ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        cfg, start = self.cfg, time.time()
        save_config(cfg.out_dir, cfg)
        # 0. reference log-probs for the whole dataset, once, before any update
        if cfg.precompute_ref:
            self.ref_tables["train"] = self.reference_table(self.pairs, cfg.train_data, "train")
            if self.eval_pairs is not None:
                self.ref_tables["eval"] = self.reference_table(self.eval_pairs,
                                                               cfg.eval_pref_data, "eval")
        eval_before, pref_before = self.s.evaluate(self.model), self.evaluate_pairs()
        self.logger.log(0, _eval_metrics(eval_before, pref_before))
        history: list[dict[str, float]] = []
        self.model.train()
        with self.s.progress(cfg.max_steps, cfg.loss_type) as bar:
            for step in range(1, cfg.max_steps + 1):
                t0 = time.time()
                idx = self.next_indices(cfg.batch_size)  # 1 batch of pairs
                metrics = self.update(idx)  # 2 policy, 3 reference, 4 loss + step
                metrics.update({"perf/step_seconds": time.time() - t0,
                                "perf/peak_rss_mb": peak_rss_mb()})
                if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
                    metrics.update(_eval_metrics(self.s.evaluate(self.model),
                                                 self.evaluate_pairs()))
                    self.model.train()
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    history.append({"step": step, **self.logger.log(step, metrics)})
                if cfg.save_every and step % cfg.save_every == 0:
                    save_checkpoint(self.model, self.tok, f"{cfg.out_dir}/checkpoint")
                bar.update(loss=metrics.get("loss/dpo"), acc=metrics.get("rewards/accuracy"))
        eval_after, pref_after = self.s.evaluate(self.model), self.evaluate_pairs()
        self.logger.log(cfg.max_steps, _eval_metrics(eval_after, pref_after))
        self.logger.close()
        save_checkpoint(merged(self.model), self.tok, f"{cfg.out_dir}/final")
        summary = {
            "eval_before": eval_before.get("accuracy"), "eval_after": eval_after.get("accuracy"),
            "implicit_acc_before": pref_before.get("accuracy"),
            "implicit_acc_after": pref_after.get("accuracy"),
            "eval_before_detail": eval_before, "eval_after_detail": eval_after,
            "pref_before_detail": pref_before, "pref_after_detail": pref_after,
            "ref_cache": self.ref_cache, "seconds": round(time.time() - start, 1),
            "steps": cfg.max_steps, "history": history}
        write_summary(cfg.out_dir, cfg, **summary)
        return summary

    # ------------------------------------------------------------------------------------------
    def next_indices(self, n: int) -> Tensor:
        """The next ``n`` pair indices, reshuffling at each epoch boundary."""
        out = []
        while len(out) < n:
            if not self._order:
                self._order = torch.randperm(len(self.pairs), generator=self.gen).tolist()
            out.append(self._order.pop())
        return torch.tensor(out, dtype=torch.long)

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The frozen reference policy, in eval mode, for the duration of the block."""
        if self.ref is not None:
            yield self.ref
            return
        if self.cfg.lora_r == 0 and self._updated:
            raise RuntimeError("the policy is no longer the reference after an update; set "
                               "precompute_ref: true or keep a reference model")
        was_training = self.model.training
        self.model.eval()
        try:
            if self.cfg.lora_r > 0:
                with adapters_disabled(self.model) as base:
                    yield base
            else:
                yield self.model
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def reference_table(self, pairs: PairTensors, source: str, name: str) -> dict[str, Tensor]:
        """Reference log-probs of every pair (each of REF_KEYS -> [M]), cached on disk."""
        path = ref_cache_path(self.cfg, source, pairs)
        if path.is_file():
            table = load_file(str(path))
            if set(table) == set(REF_KEYS) and all(v.shape[0] == len(pairs)
                                                   for v in table.values()):
                self.ref_cache[name] = f"hit {path}"
                return table
        table = {k: [] for k in REF_KEYS}
        with self.reference() as ref:
            for micro in torch.arange(len(pairs)).split(self.cfg.micro_batch_size):
                out = pair_logprobs(ref, pairs.select(micro), self.cfg.autocast_bf16)
                for k in REF_KEYS:
                    table[k].append(out[k])
        result = {k: torch.cat(v).float().cpu().contiguous() for k, v in table.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(result, str(tmp), metadata={"model": self.cfg.model, "data": source,
                                              "pairs": str(len(pairs))})
        os.replace(tmp, path)
        self.ref_cache[name] = f"miss {path}"
        return result

    def reference_logps(self, pairs: PairTensors, idx: Tensor, table: str) -> tuple[Tensor, Tensor]:
        """3: reference log-probs [n] of chosen and rejected (table lookup or a forward pass)."""
        kind = "mean" if self.cfg.loss_type == "ipo" else "sum"
        if table in self.ref_tables:
            ref, device = self.ref_tables[table], next(self.model.parameters()).device
            return ref[f"chosen_{kind}"][idx].to(device), ref[f"rejected_{kind}"][idx].to(device)
        with torch.no_grad(), self.reference() as model:
            out = pair_logprobs(model, pairs.select(idx), self.cfg.autocast_bf16)
        return out[f"chosen_{kind}"], out[f"rejected_{kind}"]

    def pair_loss(self, pairs: PairTensors, idx: Tensor,
                  table: str) -> tuple[Tensor, dict[str, Tensor]]:
        """2-4 for the pairs ``idx``: per-pair loss [n] and detached metrics."""
        cfg = self.cfg
        kind = "mean" if cfg.loss_type == "ipo" else "sum"
        policy = pair_logprobs(self.model, pairs.select(idx), cfg.autocast_bf16)  # 2
        ref_chosen, ref_rejected = self.reference_logps(pairs, idx, table)  # 3
        chosen, rejected = policy[f"chosen_{kind}"], policy[f"rejected_{kind}"]  # [n], [n]
        loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta,
                                 loss_type=cfg.loss_type,
                                 label_smoothing=cfg.label_smoothing)  # 4, [n]
        if cfg.rpo_alpha > 0:  # RPO: + alpha * NLL of the chosen completion (token mean)
            nll = -policy["chosen_mean"]  # [n]
            loss = loss + cfg.rpo_alpha * nll  # [n]
            metrics["loss/nll_chosen"] = nll.detach().mean()
        metrics["logps/chosen"] = policy["chosen_sum"].detach().mean()
        metrics["logps/rejected"] = policy["rejected_sum"].detach().mean()
        metrics["rewards/ref_accuracy"] = (ref_chosen > ref_rejected).float().mean()
        return loss, metrics

    def update(self, idx: Tensor) -> dict[str, float]:
        """One optimizer step over the batch ``idx``, micro-batched; loss = mean over the batch."""
        cfg, B = self.cfg, len(idx)
        acc: dict[str, float] = {}
        for micro in idx.split(cfg.micro_batch_size):
            loss, metrics = self.pair_loss(self.pairs, micro, "train")
            (loss.sum() / B).backward()  # normalised over the whole step, not the micro-batch
            metrics["loss/dpo"] = loss.detach().mean()
            for k, v in metrics.items():
                acc[k] = acc.get(k, 0.0) + float(v) * len(micro) / B
        acc["train/grad_norm"] = float(clip_and_step(self.model, self.opt, self.sched,
                                                     cfg.max_grad_norm))
        acc["train/lr"] = self.sched.get_last_lr()[0]
        self._updated = True
        return acc

    @torch.no_grad()
    def evaluate_pairs(self) -> dict[str, float]:
        """Held-out implicit-reward accuracy, margin and loss on ``eval_pref_data``."""
        if self.eval_pairs is None:
            return {}
        was_training = self.model.training
        self.model.eval()
        M, acc = len(self.eval_pairs), {}
        for micro in torch.arange(M).split(self.cfg.micro_batch_size):
            loss, metrics = self.pair_loss(self.eval_pairs, micro, "eval")
            metrics["loss"] = loss.mean()
            for k, v in metrics.items():
                key = k.split("/")[-1] if k.startswith("rewards/") else k.replace("/", "_")
                acc[key] = acc.get(key, 0.0) + float(v) * len(micro) / M
        self.model.train(was_training)
        return {**acc, "n": M}


def _eval_metrics(greedy: dict[str, Any], pref: dict[str, float]) -> dict[str, float]:
    out = {f"eval/{k}": v for k, v in greedy.items() if isinstance(v, (int, float))}
    out.update({f"eval_pref/{k}": v for k, v in pref.items()})
    return out


def _validate(cfg: DPOConfig) -> None:
    checks = {
        "beta": (cfg.beta > 0, "expected > 0"),
        "batch_size": (cfg.batch_size >= 1, "expected >= 1"),
        "micro_batch_size": (cfg.micro_batch_size >= 1, "expected >= 1"),
        "label_smoothing": (0.0 <= cfg.label_smoothing < 0.5, "expected in [0, 0.5)"),
        "lora_r": (cfg.lora_r >= 0, "expected >= 0 (0 trains all weights)"),
        "rpo_alpha": (cfg.rpo_alpha >= 0, "expected >= 0 (0 disables the NLL term)"),
    }
    for key, (ok, msg) in checks.items():
        if not ok:
            raise ConfigError(f"config key '{key}'={getattr(cfg, key)!r}: {msg}")
