"""One forward pass over each distinct prompt of a micro-batch, shared by all its completions.

GRPO samples G completions of every prompt and DPO scores a chosen and a rejected completion of
every prompt, so a micro-batch holds each prompt several times. The plain forward pass runs the
transformer over every (prompt, completion) row in full, computing the prompt's hidden states
and keys/values once per row although they are the same in every row of a group (a causal model
never lets a prompt position see the completion). Here the prompt runs once per distinct prompt
with a KV cache, the cache is expanded to the rows that share it (an index, differentiable: the
gradient from all G completions flows back into the one prefix pass), and the completions run
on top of it. The same function of the same weights; only float summation order may differ.
Compute saved: (n - u) x P token-passes of the body for u distinct prompts among n rows.
(The idea is also known as shared-prefix or "prefix grouper" training.)

Used by `posttrain.trainers.forward.completion_logprobs` when asked to (``share_prefix``) and the
model qualifies (`shared_prefix_supported`); otherwise the plain forward runs.

Notation: n rows, u distinct prompts, P prompt tokens (left padded), T completion tokens (right
padded), X the width of the model's output (V logits, or H when the head is the identity).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache

from posttrain.rollout.hf import cache_kwarg

__all__ = ["prefix_groups", "shared_prefix_outputs", "shared_prefix_supported"]

# decoder-only families whose forward takes a `DynamicCache` of plain (full) layers and whose
# masks are built from the 2-D attention mask and the cache length, checked against
# transformers' modeling code (sliding windows are applied by the mask, so they are fine)
SHARED_PREFIX_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe",
                                    "qwen3_moe", "phi3", "olmo2"})


def shared_prefix_supported(model: torch.nn.Module) -> bool:
    """A listed family, not checkpointing activations: transformers' checkpointed decoder layers
    drop the cache argument when they run with grad in training mode (the backward's replay
    would write to it again), so the completions would not see the prompt at all."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    checkpointing = model.training and any(getattr(m, "gradient_checkpointing", False) is True
                                           for m in model.modules())
    return model_type in SHARED_PREFIX_FAMILIES and not checkpointing


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
    every row has its own prompt (nothing to share: run the plain forward instead).

    Args:
        prompt_ids, prompt_mask: [n, P] left padded; completion_ids, response_mask: [n, T],
            already trimmed of all-padding columns.
    Returns:
        [n, T, X]: row i, column t predicts completion_ids[i, t] (as the plain forward's
        ``out[:, P - 1 : P + T - 1]``).
    """
    first, inverse = prefix_groups(prompt_ids, prompt_mask)
    n, P = prompt_ids.shape
    if first.shape[0] == n:
        return None
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()  # [n, P+T]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P+T], as in the plain forward
    cache = DynamicCache()
    kw = {cache_kwarg(model): cache, "use_cache": True}
    last = model(input_ids=prompt_ids[first], attention_mask=attn[first, :P],
                 position_ids=pos[first, :P], logits_to_keep=1,
                 **kw).logits  # [u, 1, X]: predicts each completion's first token
    cache.batch_select_indices(inverse)  # every layer's keys/values [u, ...] -> [n, ...]
    rest = model(input_ids=completion_ids, attention_mask=attn, position_ids=pos[:, P:],
                 **kw).logits  # [n, T, X]
    return torch.cat([last[inverse], rest[:, :-1]], dim=1)  # [n, T, X]
