"""A KV cache for the decode loop that writes in place instead of growing by concatenation.

transformers' ``DynamicLayer`` appends each new token's keys and values with ``torch.cat``, which
copies the whole cache of every layer at every decode step: O(T^2) bytes over a generation. On
the CPU that copy was half of a decode step's time (19M Llama, 64 rows, 48 positions: 2.4 ms of
``aten::cat`` per layer and step under bf16 autocast, more than all the matrix multiplies).
`PreallocatedLayer` allocates ``[B, H, capacity, D]`` once and writes each token into it; it
returns views of the filled positions, so attention sees exactly the tensors a ``DynamicLayer``
would hand it (same lengths, same values, same masks) and the samples do not change.

Multi-turn sequences carry their cache from one turn to the next (`cache_rows`, `carry_rows`):
the rows of finished sequences are dropped, the others keep their cached positions.

Notation: B rows, H key/value heads, L cached positions, D head dimension.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["PreallocatedLayer", "cache_rows", "can_carry", "carry_rows", "decode_cache"]

RowsKV = list[tuple[Tensor, Tensor] | None]
"""Each layer's cached keys and values of some rows, [m, H, L, D] each (None: a layer that
holds nothing, e.g. a test model that keeps no cache)."""


def _dynamic_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class PreallocatedLayer(_dynamic_layer_class()):  # type: ignore[misc]
    """A ``DynamicLayer`` whose keys/values live in a buffer of `capacity` positions.

    ``self.keys`` / ``self.values`` are views ``[B, H, L, D]`` of the filled part of the buffers
    ``[B, H, capacity, D]``, so every reader of a ``DynamicLayer`` (masks, sequence length,
    ``batch_select_indices``) sees the same thing. Writing past `capacity` raises.
    """

    def __init__(self, capacity: int, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.capacity = int(capacity)
        self.dtype = dtype  # the buffers' dtype (None: the first keys/values'); writes cast
        self.length = 0
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, H, _, Dk = key_states.shape
        self.device = key_states.device
        self._k = key_states.new_empty((B, H, self.capacity, Dk), dtype=self.dtype)
        self._v = value_states.new_empty((B, H, self.capacity, value_states.shape[-1]),
                                         dtype=self.dtype)
        self.length = 0
        self._refresh()
        self.is_initialized = True

    def _refresh(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Write key_states/value_states [B, H, l, D] after the cached positions; return the
        cache views [B, H, L + l, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._k is not None and self._v is not None
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"PreallocatedLayer: {end} positions exceed the capacity "
                               f"{self.capacity}")
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def put_rows(self, rows: list[int], n: int, key_states: Tensor, value_states: Tensor
                 ) -> None:
        """Make key_states/value_states [m, H, L, D] the cached positions of `rows` of an
        empty layer of `n` rows (every row gets its positions from one such call)."""
        if not self.is_initialized:
            B, H, L, D = key_states.shape
            self.lazy_initialization(key_states.new_empty((n, H, 0, D)),
                                     value_states.new_empty((n, H, 0, value_states.shape[-1])))
            self.length = L
        assert self._k is not None and self._v is not None
        at = slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else rows
        self._k[at, :, : self.length] = key_states  # a slice copies, a list scatters (slower)
        self._v[at, :, : self.length] = value_states
        self._refresh()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            assert self._k is not None and self._v is not None
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._refresh()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            assert self._k is not None and self._v is not None
            self._k, self._v = self._k[indices], self._v[indices]
            self._refresh()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._refresh()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._refresh()


def decode_cache(model: torch.nn.Module, capacity: int) -> Any:
    """The cache for one generation of at most `capacity` positions (prompt + new tokens).

    A ``DynamicCache`` built from the model's config, with every plain full-attention
    ``DynamicLayer`` replaced by a `PreallocatedLayer`; other layer kinds (sliding window,
    linear attention) are kept as transformers builds them. A model with a ``kv_cache_dtype``
    attribute (the bf16 sampler copy on a CPU without AMX) has its keys/values kept in it.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    dynamic = _dynamic_layer_class()
    if not cache.layers:  # no config-derived layers: transformers would add them lazily
        return cache
    dtype = getattr(model, "kv_cache_dtype", None)
    cache.layers = [PreallocatedLayer(capacity, dtype) if type(layer) is dynamic else layer
                    for layer in cache.layers]
    return cache


def can_carry(cache: Any) -> bool:
    """Whether rows of `cache` can be carried to another turn: every layer a `PreallocatedLayer`
    (plain full attention). Sliding-window and recurrent layers cannot: their state depends on
    what was fed in which column."""
    return bool(cache.layers) and all(isinstance(x, PreallocatedLayer) for x in cache.layers)


def cache_rows(cache: Any, rows: Tensor | None = None) -> RowsKV:
    """The cached keys/values of `rows` [m] (all rows: None, as views, no copy)."""
    return [None if not x.is_initialized else
            (x.keys, x.values) if rows is None else (x.keys[rows], x.values[rows])
            for x in cache.layers]


def carry_rows(model: torch.nn.Module, parts: list[tuple[RowsKV, Tensor]],
               picks: list[tuple[int, int]], capacity: int) -> tuple[Any, Tensor]:
    """A new `decode_cache` of `capacity` positions whose row i is row `picks[i] = (part, row)`
    of `parts` [(each layer's keys/values, valid [m, L_p] bool: the columns that hold the
    sequence; gaps and padding False)], its valid columns kept in order and right-aligned.

    Returns the cache and its valid columns [n, L] bool, L the most valid columns of a row:
    every sequence keeps its tokens' keys and values, only the masked columns between them go."""
    cache = decode_cache(model, capacity)
    groups: dict[int, tuple[list[int], list[int]]] = {}  # part -> (new rows, its rows)
    for i, (p, r) in enumerate(picks):
        groups.setdefault(p, ([], []))[0].append(i)
        groups[p][1].append(r)
    device = parts[0][1].device if parts else torch.device("cpu")
    counts = torch.zeros(len(picks), dtype=torch.long, device=device)  # [n]
    for p, (dest, src) in groups.items():
        counts[dest] = parts[p][1][src].sum(1)
    L = int(counts.max()) if picks else 0
    for p, (dest, src) in groups.items():
        kv, valid = parts[p]
        cols = _right_aligned(valid[src], L)  # [m, L] source column of each new column
        rows = torch.tensor(src, device=device)[:, None].expand_as(cols)  # [m, L]
        for layer, layer_kv in zip(cache.layers, kv, strict=True):
            if layer_kv is not None:  # [m, L, H, D] -> [m, H, L, D]
                layer.put_rows(dest, len(picks), *(t[rows, :, cols].transpose(1, 2)
                                                   for t in layer_kv))
    return cache, torch.arange(L, device=device)[None, :] >= (L - counts)[:, None]


def _right_aligned(valid: Tensor, L: int) -> Tensor:
    """For each row of `valid` [m, L_p] bool, the source column of each of L new columns: its
    valid columns in order, ending at column L - 1 (the columns before them repeat the first
    valid one: finite, and masked out). Returns [m, L] long."""
    count = valid.sum(1)  # [m]
    order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices  # valid first
    j = torch.arange(L, device=valid.device)[None, :] - (L - count)[:, None]  # [m, L]
    return order.gather(1, j.clamp(0, max(valid.shape[1] - 1, 0)))
