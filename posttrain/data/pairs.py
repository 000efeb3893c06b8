"""Preference pairs as tensors: chat-templated prompts (left padded) and chosen / rejected
completions (right padded, ``completion + EOS`` as SFT trains them), shared by DPO, KTO (a row's
completion and a mismatched one) and the pairwise reward model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from posttrain.data.loading import DataError
from posttrain.data.prompts import TemplateError, tokenize_completions


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
                   source: str, template: str = "auto") -> PairTensors:
    """Chat-template the prompts and tokenize ``completion + EOS`` (a conversational side: the
    template's rendering of its messages after the prompt); bad rows raise DataError."""
    for i, row in enumerate(rows):
        if row["chosen"] == row["rejected"]:
            raise DataError(source, i + 1, "rejected", "identical to 'chosen'; a preference "
                            "pair needs two different completions")
    return _pair_tensors(tokenizer, rows, max_len, source, template, ("chosen", "rejected"))


def tokenize_unpaired(tokenizer: Any, rows: list[dict[str, Any]], max_len: int,
                      source: str, template: str = "auto") -> PairTensors:
    """KTO's unpaired rows as pairs: ``chosen`` is each row's own completion, ``rejected`` a
    MISMATCHED one for KTO's reference point: the completion of another row under this row's
    prompt, the rows taken round one fixed seeded cycle (TRL rotates completions by one within a
    batch; a fixed pairing lets the reference's log-probs be precomputed and cached)."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    other = {order[k]: order[k - 1] for k in range(len(rows))}  # row -> the row it borrows from
    shifted = [{"prompt": r["prompt"], "completion": r["completion"],
                "mismatched": rows[other[i]]["completion"]} for i, r in enumerate(rows)]
    return _pair_tensors(tokenizer, shifted, max_len, source, template,
                         ("completion", "mismatched"))


def _pair_tensors(tokenizer: Any, rows: list[dict[str, Any]], max_len: int, source: str,
                  template: str, sides: tuple[str, str]) -> PairTensors:
    """Tokenize and pad the two completion fields ``sides`` of each row (with its prompt)."""
    try:
        p_ids, c_ids = tokenize_completions(tokenizer, rows, sides[0], template)
        _, r_ids = tokenize_completions(tokenizer, rows, sides[1], template)
    except TemplateError as err:
        raise DataError(source, (err.row or 0) + 1, err.field, str(err)) from err
    for i, (p, c, r) in enumerate(zip(p_ids, c_ids, r_ids, strict=True)):
        for name, comp in zip(sides, (c, r), strict=True):
            if not comp:  # EOS is already on each side
                raise DataError(source, i + 1, name, "empty, and the tokenizer has no EOS token")
            if len(p) + len(comp) > max_len:
                n = len(p) + len(comp)
                raise DataError(source, i + 1, name, f"prompt + {name} is {n} tokens, over "
                                f"max_seq_len={max_len} (raise max_seq_len or drop the row)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    P = max(len(p) for p in p_ids)
    T = max(len(x) for x in c_ids + r_ids)
    M = len(rows)
    prompt_ids = torch.full((M, P), pad, dtype=torch.long)  # [M, P]
    prompt_mask = torch.zeros((M, P), dtype=torch.bool)  # [M, P]
    comp = {k: torch.full((M, T), pad, dtype=torch.long) for k in sides}
    mask = {k: torch.zeros((M, T), dtype=torch.bool) for k in sides}
    for i, p in enumerate(p_ids):
        prompt_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, P - len(p):] = True
        for k, ids in zip(sides, (c_ids[i], r_ids[i]), strict=True):
            comp[k][i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[k][i, : len(ids)] = True
    return PairTensors(prompt_ids, prompt_mask, comp[sides[0]], mask[sides[0]],
                       comp[sides[1]], mask[sides[1]])
