"""Packed forwards: the rows of a micro-batch as one sequence [1, S], no padding computed.

Each row's real tokens (prompt, then completion) are concatenated; position ids restart at 0
for each row and no attention mask is passed. Attention stays within each row by one of two
paths: models with full causal attention only, loaded with sdpa or eager (Llama, Qwen2/3, ...),
run `row_attention`, sdpa per row (sum of L^2, no [S, S] mask); the others (sliding windows,
softcapping, flash attention) keep their own kernel and transformers' mask builder reads the
row boundaries off the position ids (`find_packed_sequence_indices`: a block-diagonal mask,
S^2, for eager / sdpa; varlen for flash attention). `packing_problem` checks once per model that
packed rows give each row's own outputs (a model that ignores them is refused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface

from posttrain.core.padding import count_positions

ROWS = "posttrain_rows"
_checked: dict[tuple[int, str], str | None] = {}


def row_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, dropout: float = 0.0,
                  scaling: float | None = None, position_ids: Tensor | None = None,
                  **_: Any) -> tuple[Tensor, None]:
    """Causal sdpa within each packed row (rows start where position ids are 0).

    query [1, H, S, D], key / value [1, H_kv, S, D] -> ([1, S, H, D], None)."""
    if position_ids is None:
        raise ValueError("packed attention needs the position ids")
    S = query.shape[2]
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist() + [S]
    gqa = query.shape[1] != key.shape[1]
    drop = dropout if module.training else 0.0
    spans = [(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True) if b > a]
    parts = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=drop, is_causal=True,
        scale=scaling, enable_gqa=gqa) for a, b in spans]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None  # [1, S, H, D]


AttentionInterface.register(ROWS, row_attention)


def _full_causal(model: torch.nn.Module) -> bool:
    """Whether every layer attends causally to the whole row, with no logit softcapping."""
    config = model.config
    layers = getattr(config, "layer_types", None) or ["full_attention"]
    return (all(t == "full_attention" for t in layers)
            and not getattr(config, "use_sliding_window", False)
            and getattr(config, "attn_logit_softcapping", None) is None
            and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
            and not getattr(model, "is_activation_checkpointing", False))


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """`row_attention` for the model's layers where `_full_causal`, else no change."""
    if not _full_causal(model):
        yield
        return
    before = model.config._attn_implementation
    model.set_attn_implementation(ROWS)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def pack(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(ids [1, S], position ids [1, S] restarting per row, index [n, L] of each padded
    position in the packed sequence) of the real tokens of ids [n, L] (mask [n, L])."""
    mask = mask.bool()
    index = (mask.reshape(-1).long().cumsum(0) - 1).view(mask.shape)  # [n, L]
    pos = (mask.long().cumsum(-1) - 1)[mask]  # [S]
    return ids[mask][None], pos[None], index


def _read(out: Any) -> Tensor:
    """A causal LM's logits, or a decoder body's last hidden states."""
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def packed_outputs(model: torch.nn.Module, ids: Tensor, mask: Tensor, start: int,
                   width: int) -> Tensor:
    """The model's outputs [n, width, X] at padded columns ``start .. start + width - 1`` of
    ids [n, L] (mask [n, L], 1 on real tokens), from one packed forward; 0 where padded. A
    causal LM gives logits (its head only where kept), a decoder body its hidden states."""
    flat, pos, index = pack(ids, mask)
    window = mask[:, start:start + width].bool()  # [n, width] real positions
    keep = index[:, start:start + width][window]  # [K] ascending
    count_positions(None, flat.numel())  # packed: no padding computed
    with packed_attention(model):
        problem = packing_problem(model)
        if problem is not None:
            raise ValueError(f"config key 'packing': {problem}; set packing: false")
        if getattr(model, "get_output_embeddings", lambda: None)() is not None:  # a causal LM
            out = _read(model(input_ids=flat, position_ids=pos, use_cache=False,
                              logits_to_keep=keep))  # [1, K, X]
        else:
            out = _read(model(input_ids=flat, position_ids=pos, use_cache=False))[:, keep]
    res = out.new_zeros(window.shape + out.shape[-1:])  # [n, width, X]
    res[window] = out[0]
    return res


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run packed rows, or None: a probe of two rows (3 and 4 tokens)
    packed must give each row's own outputs (max difference <= 1e-3 of the largest in fp32,
    5e-2 in bf16 weights; rows that see each other move them by far more), outside autocast."""
    key = (id(model), model.config._attn_implementation)
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
        alone = [_read(model(input_ids=r[None], use_cache=False))[0].float() for r in rows]
        # alone: rows of one sequence each (any kernel); both: the two packed
        ids = torch.cat(rows)[None]
        pos = torch.cat([torch.arange(len(r), device=device) for r in rows])[None]
        both = _read(model(input_ids=ids, position_ids=pos, use_cache=False))[0].float()
    except (TypeError, ValueError, RuntimeError) as err:
        return f"{type(model).__name__} cannot run a packed forward ({err})"
    gap = max(float((both[:3] - alone[0]).abs().max()), float((both[3:] - alone[1]).abs().max()))
    scale = max(float(alone[1].abs().max()), 1e-6)
    if gap > tol * scale:
        return (f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')}) lets "
                f"packed rows attend to each other (logits move by {gap:.2g})")
    return None
