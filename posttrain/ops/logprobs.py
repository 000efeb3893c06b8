"""Per-token log-probabilities, entropies and sequence log-probabilities from logits.

Notation: B sequences (B prompts, or N = B*G sequences), T response tokens, V vocab.

The logits are usually bf16 and large ([B, T, V] with V ~ 1e5), so both ``token_logprobs``
and ``entropy_from_logits`` work on blocks of at most ``chunk_size`` (b, t) rows sliced from
the logits (no flattening, so a shifted view ``logits[:, :-1]`` is not copied): each block is
upcast to fp32, reduced, and dropped. Gradients go through small custom
autograd functions that recompute the softmax per chunk in the backward pass, so neither pass
keeps a full fp32 copy of [B, T, V] alive (the only full-size tensor created is the gradient
itself, in the logits' own dtype). fp64 logits stay fp64 (useful for ``gradcheck``).

The caller shifts: ``logits[b, t]`` must be the distribution that produced ``tokens[b, t]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.ops.masked import masked_mean, masked_sum

DEFAULT_CHUNK_SIZE = 512


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _grid_chunks(b: int, t: int, chunk_size: int) -> list[tuple[slice, slice]]:
    """Cover the [B, T] grid with blocks of at most ``chunk_size`` rows.

    Blocks are sliced from the 3-D logits directly, so a non-contiguous input such as
    ``logits[:, :-1]`` is never flattened (which would copy all of it).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if t >= chunk_size:
        return [(slice(i, i + 1), slice(j, min(j + chunk_size, t)))
                for i in range(b) for j in range(0, t, chunk_size)]
    rows = max(chunk_size // max(t, 1), 1)
    return [(slice(i, min(i + rows, b)), slice(0, t)) for i in range(0, b, rows)]


class _TokenLogprobs(torch.autograd.Function):
    """logp[b, t] = z[b, t, tok] - logsumexp(z[b, t]) with z = logits / temperature, by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk_size: int):
        dtype = _compute_dtype(logits.dtype)
        idx = tokens.long().unsqueeze(-1)  # [B, T, 1]
        out = torch.empty(tokens.shape, dtype=dtype, device=logits.device)  # [B, T]
        lse = torch.empty_like(out)  # [B, T]
        for rows, cols in _grid_chunks(*tokens.shape, chunk_size):
            z = logits[rows, cols].to(dtype) / temperature  # [b, t, V] fp32
            lse[rows, cols] = torch.logsumexp(z, dim=-1)  # [b, t]
            out[rows, cols] = z.gather(-1, idx[rows, cols]).squeeze(-1) - lse[rows, cols]
        ctx.save_for_backward(logits, idx, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, idx, lse = ctx.saved_tensors
        go = grad_out.to(lse.dtype).unsqueeze(-1)  # [B, T, 1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        for rows, cols in _grid_chunks(*lse.shape, ctx.chunk_size):
            z = logits[rows, cols].to(lse.dtype) / ctx.temperature  # [b, t, V]
            g = torch.exp(z - lse[rows, cols, None]).mul_(-go[rows, cols])  # [b, t, V] -p*go
            g.scatter_add_(-1, idx[rows, cols], go[rows, cols])  # [b, t, V] (onehot - p)*go
            grad[rows, cols] = (g / ctx.temperature).to(grad.dtype)
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """H[b, t] = -sum_v p log p with p = softmax(logits[b, t] / temperature), by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int):
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)  # [B, T]
        for rows, cols in _grid_chunks(*out.shape, chunk_size):
            logp = torch.log_softmax(logits[rows, cols].to(dtype) / temperature, -1)  # [b, t, V]
            out[rows, cols] = -(logp.exp() * logp).sum(-1)  # [b, t]
        ctx.save_for_backward(logits, out)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, ent = ctx.saved_tensors
        go = grad_out.to(ent.dtype).unsqueeze(-1)  # [B, T, 1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        for rows, cols in _grid_chunks(*ent.shape, ctx.chunk_size):
            z = logits[rows, cols].to(ent.dtype) / ctx.temperature  # [b, t, V]
            logp = torch.log_softmax(z, dim=-1)  # [b, t, V]
            # dH/dz_v = -p_v * (log p_v + H)
            g = -(logp.exp() * (logp + ent[rows, cols, None])) * go[rows, cols]  # [b, t, V]
            grad[rows, cols] = (g / ctx.temperature).to(grad.dtype)
        return grad, None, None


def _as_3d(logits: Tensor, name: str) -> Tensor:
    if logits.dim() == 3:
        return logits
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    raise ValueError(f"{name}: logits must be [B, T, V] (or [T, V]), got {tuple(logits.shape)}")


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Log-probability of each sampled token, ``log softmax(logits / temperature)[tokens]``.

    Args:
        logits: [B, T, V], any float dtype (bf16 is upcast one chunk at a time).
        tokens: [B, T] integer ids, already aligned with ``logits`` (caller shifts).
        temperature: the sampling temperature (use the SAME one as sampling).
        chunk_size: (b, t) rows processed at once; bounds the extra fp32 memory to about
            ``chunk_size * V`` floats per live temporary, in forward and backward.

    Returns:
        [B, T] fp32 (fp64 for fp64 logits); differentiable with respect to ``logits``.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"token_logprobs: logits {tuple(logits.shape)} must be tokens {tuple(tokens.shape)}"
            " plus a trailing vocab dim"
        )
    _check_temperature(temperature)
    tokens_2d = tokens.reshape(-1, tokens.shape[-1])  # [B, T]
    out = _TokenLogprobs.apply(_as_3d(logits, "token_logprobs"), tokens_2d,
                               float(temperature), int(chunk_size))  # [B, T]
    return out.view(tokens.shape)


def entropy_from_logits(
    logits: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> Tensor:
    """Entropy of the full next-token distribution (docs/algorithms.md).

    Args:
        logits: [B, T, V] any float dtype.
        chunk_size: (b, t) rows processed at once (see ``token_logprobs``).
        temperature: divide logits by this first (1.0 = the raw model distribution).

    Returns:
        [B, T] fp32 entropy in nats, differentiable with respect to ``logits``.
    """
    _check_temperature(temperature)
    out = _Entropy.apply(_as_3d(logits, "entropy_from_logits"), float(temperature),
                         int(chunk_size))  # [B, T]
    return out.view(logits.shape[:-1])


def sequence_logprobs(logprobs: Tensor, response_mask: Tensor, average: bool = False) -> Tensor:
    """Sequence log-probability ``sum_t m * logp`` (``average=True``: mean over real tokens).

    Args:
        logprobs: [B, T] per-token log-probs.
        response_mask: [B, T] True on real completion tokens.
        average: token-averaged log-prob (what IPO uses, Azar et al. 2023).

    Returns:
        [B]
    """
    if average:
        return masked_mean(logprobs, response_mask, dim=-1)  # [B]
    return masked_sum(logprobs, response_mask, dim=-1)  # [B]
