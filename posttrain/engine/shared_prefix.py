"""One forward pass over each distinct prompt of a micro-batch, shared by all its completions.

GRPO's G completions and DPO's chosen / rejected repeat each prompt in a micro-batch. Here the
prompt runs once per distinct prompt with a KV cache, the cache is expanded to the rows that
share it (an index, differentiable: the gradient of all rows flows into the one prefix pass), and
the completions run on top of it: the same function, only float summation order may differ;
(n - u) x P body token-passes saved. The completions run in a few groups of similar length
(`length_buckets`), each padded to its own longest completion.

Used by `posttrain.engine.forward.completion_logprobs` when asked to (``share_prefix``) and the
model qualifies (`shared_prefix_supported`); otherwise the plain forward runs.
Notation: n rows, u distinct prompts, P prompt tokens (left padded), T completion tokens (right
padded), X the width of the model's output (V logits, or H when the head is the identity).
More: docs/performance.md, "Module notes", posttrain.engine.shared_prefix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from posttrain.core.padding import count_positions
from posttrain.rollout.hf import cache_kwarg

__all__ = ["length_buckets", "prefix_groups", "shared_prefix_outputs", "shared_prefix_supported"]

# decoder-only families whose forward takes a `DynamicCache` of plain (full) layers and whose
# masks are built from the 2-D attention mask and the cache length, checked against
# transformers' modeling code (sliding windows are applied by the mask, so they are fine)
SHARED_PREFIX_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe",
                                    "qwen3_moe", "phi3", "olmo2"})
# the completions run in length groups (`length_buckets`): at most this many, of at least this
# many rows, and only a split that saves at least this share of the padded positions (a
# smaller one would not pay for one more forward call on a small model)
MAX_BUCKETS = 4
MIN_BUCKET_ROWS = 4
MIN_SAVING = 0.05


def shared_prefix_supported(model: torch.nn.Module) -> bool:
    """A listed family, without active dropout, and checkpointing activations (if at all)
    without reentrant autograd.

    Dropout in training mode would draw one mask for a prompt's states where the plain forward
    draws one per row: a different random function. Under checkpointing the cache reaches the
    decoder layers through `_cache_through_checkpoints`, and each layer's backward replay
    recomputes the same keys/values (`OneCallLayer`); reentrant checkpointing would not carry
    the gradient of the prompt's keys/values, which live in the cache, not in the layer's
    arguments, so it keeps the plain forward.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SHARED_PREFIX_FAMILIES:
        return False
    if not model.training:
        return True
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            return False
        if getattr(m, "gradient_checkpointing", False) is True and not _non_reentrant(m):
            return False
    return True


def _non_reentrant(module: torch.nn.Module) -> bool:
    """Whether a checkpointing module can keep the cache: non-reentrant
    ``torch.utils.checkpoint``, in a transformers that lets a layer keep its cache argument
    (``_can_checkpoint_with_cache``; older versions drop it). A model whose flag is set but
    that carries no function itself is fine: its layers carry it."""
    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        return False
    func = getattr(module, "_gradient_checkpointing_func", None)
    if func is None:
        return not isinstance(module, GradientCheckpointingLayer)
    return getattr(func, "keywords", {}).get("use_reentrant") is False


class OneCallLayer(DynamicLayer):
    """A cache layer for a single forward call: a fixed prefix (or none) and the call's states.

    `update` returns ``cat(prefix, new)`` like a ``DynamicLayer``, but a layer without a prefix
    (the prompt pass) keeps only what its first call saw and a layer with one keeps nothing: a
    checkpointed decoder layer's backward replay calls it again with recomputed states and must
    get the same shapes back, not a cache grown twice. The prefix rows are gathered in
    `update`, inside the (checkpointed) layer, so that until the backward only the u distinct
    prefixes stay alive, not one copy per row (nor the concatenated keys/values).

    Args:
        keys, values: [u, H_kv, P, D] the prefix, or None (the prompt pass).
        rows: [n] the prefix row each row of the call continues.
    """

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None,
                 rows: Tensor | None = None) -> None:
        super().__init__()
        self.prefix = None if keys is None or values is None else (keys, values)
        self.rows = rows
        if self.prefix is not None:
            self.keys, self.values = self.prefix
            self.device, self.is_initialized = keys.device, True  # type: ignore[union-attr]

    def update(self, key_states: Tensor, value_states: Tensor, *args: object,
               **kwargs: object) -> tuple[Tensor, Tensor]:
        if self.prefix is not None:
            keys, values = self.prefix
            if self.rows is not None:
                keys, values = keys[self.rows], values[self.rows]  # [n, H_kv, P, D]
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
        if not self.is_initialized:  # the first call (a replay's states are not kept)
            self.keys, self.values = key_states, value_states
            self.device, self.is_initialized = key_states.device, True
        return key_states, value_states


def _one_call_cache(prefix: list[tuple[Tensor, Tensor]] | None = None,
                    rows: Tensor | None = None) -> DynamicCache:
    """A ``DynamicCache`` of `OneCallLayer`s: empty ones made as the layers ask, or one per
    (keys, values) of `prefix`, continued by `rows`."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = OneCallLayer
    if prefix is not None:
        cache.layers = [OneCallLayer(k, v, rows) for k, v in prefix]
    return cache


@contextlib.contextmanager
def _cache_through_checkpoints(model: torch.nn.Module) -> Iterator[None]:
    """Let checkpointed decoder layers keep the cache argument (transformers drops it unless a
    layer says its replay is safe, ``_can_checkpoint_with_cache``; `OneCallLayer` makes it so).
    Nothing to do without grad (the reference, old log-probs): nothing is checkpointed then."""
    if not torch.is_grad_enabled():
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)
              and m.gradient_checkpointing]
    before = [m.__dict__.get("_can_checkpoint_with_cache") for m in layers]  # None: the class's
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m, value in zip(layers, before, strict=True):
            if value is None:
                del m._can_checkpoint_with_cache
            else:
                m._can_checkpoint_with_cache = value


def prefix_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct prompts of a micro-batch (any order).

    Args:
        prompt_ids, prompt_mask: [n, P].
    Returns:
        first [u]: a row holding each distinct prompt; inverse [n]: each row's prompt in `first`.
    """
    key = torch.cat([prompt_ids, prompt_mask.long()], dim=1)  # [n, 2P]: same tokens, same pads
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [n] in 0..u-1
    n, u = inverse.shape[0], int(inverse.max()) + 1 if inverse.numel() else 0
    rows = torch.arange(n, device=inverse.device)
    first = torch.full((u,), n, dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # [u]
    return first, inverse


def shared_prefix_outputs(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                          completion_ids: Tensor, response_mask: Tensor) -> Tensor | None:
    """The model's outputs at the positions that predict each completion token, or None when
    there is nothing to gain (every row has its own prompt and the completions form one length
    group): run the plain forward instead.

    Args:
        prompt_ids, prompt_mask: [n, P] left padded; completion_ids, response_mask: [n, T],
            already trimmed of all-padding columns.
    Returns:
        [n, T, X]: row i, column t predicts completion_ids[i, t] (as the plain forward's
        ``out[:, P - 1 : P + T - 1]``).
    """
    first, inverse = prefix_groups(prompt_ids, prompt_mask)
    (n, P), T = prompt_ids.shape, completion_ids.shape[1]
    ends = (response_mask * torch.arange(1, T + 1, device=response_mask.device)).amax(-1)  # [n]
    groups = length_buckets(ends)
    if first.shape[0] == n and len(groups) == 1:
        return None
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()  # [n, P+T]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P+T], as in the plain forward
    # the caches are passed in; use_cache=True would only ask the model to make one (and, under
    # checkpointing, make transformers warn that it turns caching off)
    cache, outs = _one_call_cache(), []
    count_positions(attn[first, :P])
    with _cache_through_checkpoints(model):
        last = model(input_ids=prompt_ids[first], attention_mask=attn[first, :P],
                     position_ids=pos[first, :P], logits_to_keep=1, use_cache=False,
                     **{cache_kwarg(model): cache}).logits  # [u, 1, X]: predicts each first token
        prefix = [(layer.keys, layer.values) for layer in cache.layers]  # [u, H_kv, P, D] each
        for rows in groups:
            t = max(int(ends[rows].max()), 1)  # this group's columns: its longest completion
            src = inverse[rows]  # [n_g] each row's prompt
            sub = _one_call_cache(prefix, src)  # each row's prompt, gathered per layer
            count_positions(response_mask[rows, :t])
            rest = model(input_ids=completion_ids[rows, :t], attention_mask=attn[rows, :P + t],
                         position_ids=pos[rows, P:P + t], use_cache=False,
                         **{cache_kwarg(model): sub}).logits  # [n_g, t, X]
            out = torch.cat([last[src], rest[:, :-1]], dim=1)  # [n_g, t, X]
            outs.append(torch.nn.functional.pad(out, (0, 0, 0, T - t)))  # zeros where masked
    if len(groups) == 1:
        return outs[0]
    return torch.cat(outs)[torch.argsort(torch.cat(groups))]  # [n, T, X] in row order


def length_buckets(lengths: Tensor, max_buckets: int | None = None,
                   min_rows: int | None = None) -> list[Tensor]:
    """Rows grouped by length, so that each group is padded only to its own longest row.

    Greedy: the rows sorted by length are split where one split saves the most padded token
    positions, while a split saves at least `MIN_SAVING` of the single group's positions and
    leaves every group `min_rows` rows (fewer, larger matrix multiplies otherwise), up to
    `max_buckets` groups. Splitting [a, b) at s saves (s - a) x (l[b-1] - l[s-1]).

    Args:
        lengths: [n] each row's last counted position + 1.
    Returns:
        the row indices of each group (shortest group first; one group: 0..n-1 in order);
        together a permutation of 0..n-1.
    """
    max_buckets = MAX_BUCKETS if max_buckets is None else max_buckets
    min_rows = MIN_BUCKET_ROWS if min_rows is None else min_rows
    order = torch.argsort(lengths, stable=True)
    ls = lengths[order].tolist()
    n = len(ls)
    spans, floor = [(0, n)], MIN_SAVING * n * (ls[-1] if ls else 0)
    while len(spans) < max_buckets:
        best = (0, -1, -1)  # (saving, span, split)
        for k, (a, b) in enumerate(spans):
            for s in range(a + min_rows, b - min_rows + 1):
                best = max(best, ((s - a) * (ls[b - 1] - ls[s - 1]), k, s))
        saving, k, s = best
        if k < 0 or saving <= 0 or saving < floor:
            break
        a, b = spans[k]
        spans[k:k + 1] = [(a, s), (s, b)]
    if len(spans) == 1:  # no split: all rows, in their own order
        return [torch.arange(n, device=lengths.device)]
    return [order[a:b] for a, b in spans]
