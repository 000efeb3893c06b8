"""Preference pairs as tensors: chat-templated prompts (left padded) and chosen / rejected
completions (right padded, ``completion + EOS`` as SFT trains them), shared by DPO and the
pairwise reward model.
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
    try:
        p_ids, c_ids = tokenize_completions(tokenizer, rows, "chosen", template)
        _, r_ids = tokenize_completions(tokenizer, rows, "rejected", template)
    except TemplateError as err:
        raise DataError(source, (err.row or 0) + 1, err.field, str(err)) from err
    for i, (row, p, c, r) in enumerate(zip(rows, p_ids, c_ids, r_ids, strict=True)):
        if row["chosen"] == row["rejected"]:
            raise DataError(source, i + 1, "rejected", "identical to 'chosen'; a preference "
                            "pair needs two different completions")
        for name, comp in (("chosen", c), ("rejected", r)):
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
    comp = {k: torch.full((M, T), pad, dtype=torch.long) for k in ("chosen", "rejected")}
    mask = {k: torch.zeros((M, T), dtype=torch.bool) for k in ("chosen", "rejected")}
    for i, p in enumerate(p_ids):
        prompt_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, P - len(p):] = True
        for k, ids in (("chosen", c_ids[i]), ("rejected", r_ids[i])):
            comp[k][i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[k][i, : len(ids)] = True
    return PairTensors(prompt_ids, prompt_mask, comp["chosen"], mask["chosen"],
                       comp["rejected"], mask["rejected"])
