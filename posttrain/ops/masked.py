"""Masked reductions: sums, means, variances and whitening that only see real tokens.

Notation: B prompts, G samples per prompt, N = B*G sequences, T response tokens, V vocab.
``response_mask`` is bool or 0/1 with the same shape as the data; True (1) = the slot counts.

Masked slots are removed with ``torch.where`` rather than multiplied by 0, so garbage in a
padded slot (even ``inf``) changes neither the value nor the gradient of any real slot, and the
gradient that reaches a masked slot is exactly 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

Dim = int | tuple[int, ...] | None


def as_bool_mask(mask: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor (accepts bool or 0/1 of any dtype)."""
    return mask if mask.dtype == torch.bool else mask != 0


def keep(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is True, else 0. The gradient reaching masked slots is 0."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_count(mask: Tensor, dim: Dim = None, keepdim: bool = False) -> Tensor:
    """Number of True slots of ``mask`` (over ``dim``; all dims if None), as float32."""
    m = as_bool_mask(mask).to(torch.float32)
    return m.sum() if dim is None else m.sum(dim=dim, keepdim=keepdim)


def masked_sum(x: Tensor, mask: Tensor, dim: Dim = None, keepdim: bool = False) -> Tensor:
    """Sum of ``x`` over real slots; ``mask`` broadcasts against ``x``."""
    kept = keep(x, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim, keepdim=keepdim)


def masked_mean(x: Tensor, mask: Tensor, dim: Dim = None, keepdim: bool = False) -> Tensor:
    """Mean of ``x`` over real slots. A reduction with no real slot gives 0 (not nan)."""
    mask = torch.broadcast_to(as_bool_mask(mask), x.shape)
    count = masked_count(mask, dim, keepdim).clamp(min=1.0).to(x.dtype)
    return masked_sum(x, mask, dim, keepdim) / count


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True, dim: Dim = None) -> Tensor:
    """Variance of ``x`` over real slots (over ``dim``; all dims if None).

    ``unbiased=True`` divides by ``n - 1`` (Bessel, the torch default), else by ``n``.
    The denominator is clamped to at least 1, so a single real slot gives 0.
    """
    mask = torch.broadcast_to(as_bool_mask(mask), x.shape)
    mean = masked_mean(x, mask, dim, keepdim=True)  # broadcastable to x
    sq = masked_sum((keep(x, mask) - mean) ** 2, mask, dim)  # keep first: inf*0 = nan in grad
    count = masked_count(mask, dim).to(x.dtype)
    denom = (count - 1.0) if unbiased else count
    return sq / denom.clamp(min=1.0)


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """Normalize ``x`` to zero mean / unit variance over all real slots (whole batch).

    ``shift_mean=False`` only rescales (the mean is added back), as used for PPO advantages
    in some implementations. Masked slots of the result are 0.
    """
    mean = masked_mean(x, mask)  # []
    var = masked_var(x, mask, unbiased=unbiased)  # []
    whitened = (keep(x, mask) - mean) * torch.rsqrt(var + eps)  # same shape as x
    if not shift_mean:
        whitened = whitened + mean
    return keep(whitened, mask)


def trim_padding(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                 response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cut the columns that are padding in every row: leading prompt, trailing completion.

    Args:
        prompt_ids, prompt_mask: [n, P] left padded; completion_ids, response_mask: [n, T].
    Returns:
        the same four tensors, [n, P'] and [n, T'] with P' <= P, T' <= T (at least one column).
    """
    keep_p = prompt_mask.any(0)  # [P]
    first = int(keep_p.nonzero()[0]) if bool(keep_p.any()) else prompt_mask.shape[1] - 1
    keep_c = response_mask.any(0)  # [T]
    last = int(keep_c.nonzero()[-1]) + 1 if bool(keep_c.any()) else 1
    return (prompt_ids[:, first:], prompt_mask[:, first:], completion_ids[:, :last],
            response_mask[:, :last])

