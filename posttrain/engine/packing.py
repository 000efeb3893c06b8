"""Packed forwards: the rows of a micro-batch as one sequence [1, S], no padding computed.

Each row's real tokens (prompt, then completion) are concatenated; position ids restart at 0
for each row, no attention mask is passed, and transformers' mask builder (masking_utils,
`find_packed_sequence_indices`) reads the row boundaries off the position ids: causal attention
within each row only (a block-diagonal mask for eager / sdpa; varlen kernels on flash
attention). `packing_problem` checks once per model that this holds before its first packed
forward (a model that builds its own mask would let rows see each other: refused).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.core.padding import count_positions

_checked: dict[int, str | None] = {}


def pack(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(ids [1, S], position ids [1, S] restarting per row, index [n, L] of each padded
    position in the packed sequence) of the real tokens of ids [n, L] (mask [n, L])."""
    mask = mask.bool()
    index = (mask.reshape(-1).long().cumsum(0) - 1).view(mask.shape)  # [n, L]
    pos = (mask.long().cumsum(-1) - 1)[mask]  # [S]
    return ids[mask][None], pos[None], index


def packed_outputs(model: torch.nn.Module, ids: Tensor, mask: Tensor, start: int,
                   width: int) -> Tensor:
    """The model's outputs [n, width, X] at padded columns ``start .. start + width - 1`` of
    ids [n, L] (mask [n, L], 1 on real tokens), from one packed forward; 0 where padded."""
    problem = packing_problem(model)
    if problem is not None:
        raise ValueError(f"config key 'packing': {problem}; set packing: false")
    flat, pos, index = pack(ids, mask)
    window = mask[:, start:start + width].bool()  # [n, width] real positions
    keep = index[:, start:start + width][window]  # [K] ascending
    count_positions(torch.ones_like(flat))
    out = model(input_ids=flat, position_ids=pos, use_cache=False,
                logits_to_keep=keep).logits  # [1, K, X]
    res = out.new_zeros(window.shape + out.shape[-1:])  # [n, width, X]
    res[window] = out[0]
    return res


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run packed rows, or None: a probe of two rows (3 and 4 tokens)
    packed must give each row's own outputs (max difference <= 1e-3 of the largest in fp32,
    5e-2 in bf16 weights; rows that see each other move them by far more), outside autocast."""
    key = id(model)
    if key not in _checked:
        device = next(model.parameters()).device
        with torch.autocast(device.type, enabled=False):
            _checked[key] = _probe(model)
    return _checked[key]


@torch.no_grad()
def _probe(model: torch.nn.Module) -> str | None:
    """`packing_problem`'s check, run once per model."""
    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 8) or 8)
    rows = [torch.arange(1, 4, device=device) % vocab, torch.arange(4, 8, device=device) % vocab]
    tol = 5e-2 if next(model.parameters()).dtype == torch.bfloat16 else 1e-3
    try:
        alone = [model(input_ids=r[None], use_cache=False).logits[0].float() for r in rows]
        ids = torch.cat(rows)[None]
        pos = torch.cat([torch.arange(len(r), device=device) for r in rows])[None]
        both = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()
    except (TypeError, ValueError, RuntimeError) as err:
        return f"{type(model).__name__} cannot run a packed forward ({err})"
    gap = max(float((both[:3] - alone[0]).abs().max()), float((both[3:] - alone[1]).abs().max()))
    scale = max(float(alone[1].abs().max()), 1e-6)
    if gap > tol * scale:
        return (f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}) lets "
                f"packed rows attend to each other (logits move by {gap:.2g})")
    return None
