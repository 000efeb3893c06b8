"""A fused, chunked LM head + log-softmax: per-token log-probs straight from hidden states.

``head_logprobs(hidden, weight, bias, tokens)`` returns ``log softmax((hidden @ W^T + b) / tau)``
at ``tokens`` (optionally the entropy) WITHOUT holding the ``[N, T, V]`` logits: the M rows go
in blocks of ``rows`` rows (fp32 logits reduced to a log-sum-exp and the token's logit, then
dropped); the backward recomputes the logits by blocks of vocabulary columns and accumulates
``grad_hidden`` (fp32), so nothing of size M x V is allocated (Liger-Kernel's / verl's trick,
in plain torch). Numerics equal the unfused path up to matmul summation order (the head in the
weight's dtype, autocast off); `head_precision` ``tf32`` / ``bf16`` trades that for GPU speed
(log-softmax fp32 always). Block size by device (`device_block_elements`).
More: docs/performance.md, "Module notes", posttrain.ops.fused_head.

Notation: M rows (flattened n x T), H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.ops.head_blocks import (
    DEFAULT_BLOCK_ELEMENTS,
    HEAD_PRECISIONS,
    block_elements_for,
    block_rows,
    current_head_precision,
    matmul_precision,
    mm_fp32_out,
)

__all__ = ["DEFAULT_BLOCK_ELEMENTS", "block_rows", "head_logprobs"]


def _block_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                  bf16: bool = False) -> Tensor:
    """[r, H] -> fp32 [r, V] logits / temperature: in the weight's dtype with autocast off, or
    with `bf16` on bf16 inputs accumulated in fp32 (`weight` may be a bf16 copy then)."""
    if bf16:
        z = mm_fp32_out(h, weight.t())  # [r, V]
        if bias is not None:
            z = z + bias.float()
    else:
        z = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()  # [r, V]
    return z / temperature if temperature != 1.0 else z


def _weight_grad_buffer(grad_into: Tensor | None, weight: Tensor) -> Tensor:
    """Where grad_W goes: ``grad_into.grad`` (zeros if None) or a new [V, H] tensor."""
    if grad_into is None:
        return torch.empty_like(weight)
    if grad_into.grad is None:
        grad_into.grad = torch.zeros_like(grad_into)
    return grad_into.grad


class _HeadLogprobs(torch.autograd.Function):
    """logp[m] = z[m, tok[m]] - logsumexp(z[m]), z = (h W^T + b) / tau, by blocks of rows."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
                temperature: float, rows: int, with_entropy: bool, block_elements: int,
                grad_into: Tensor | None, entropy_grad: bool, precision: str):
        M, bf16 = hidden.shape[0], precision == "bf16"
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)  # [M]
        lse = torch.empty_like(logp)  # [M]
        ent = torch.zeros_like(logp)  # [M]
        w = weight.to(torch.bfloat16) if bf16 else weight  # [V, H], cast once
        with torch.autocast(device_type=hidden.device.type, enabled=False), \
                matmul_precision(precision, hidden.device):
            for s in range(0, M, rows):
                z = _block_logits(hidden[s:s + rows], w, bias, temperature, bf16)  # [r, V]
                lse[s:s + rows] = torch.logsumexp(z, dim=-1)
                tok = tokens[s:s + rows, None]  # [r, 1]
                logp[s:s + rows] = z.gather(-1, tok)[:, 0] - lse[s:s + rows]
                if with_entropy:  # H = lse - sum_v p_v z_v
                    p = torch.exp(z - lse[s:s + rows, None])  # [r, V]
                    ent[s:s + rows] = lse[s:s + rows] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent)
        ctx.temperature, ctx.block_elements = temperature, block_elements
        ctx.precision = precision
        ctx.grad_into = grad_into  # the weight leaf whose .grad receives grad_W in place
        ctx.entropy_grad = entropy_grad and with_entropy
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, grad_ent: Tensor | None):
        """By blocks of vocabulary COLUMNS: each slice of grad_W is written once (by rows, every
        block would read and write all of the [V, H] fp32 gradient: 40 passes at M = 2,048).

        With `entropy_grad`, dH/dz_v = -p_v (log p_v + H) is added per column block (from
        the saved log-sum-exp and entropy of each row). No host sync: the one-hot term of each
        row whose token lies in the block is a scatter-add (0 added for the other rows)."""
        hidden, weight, bias, tokens, lse, ent = ctx.saved_tensors
        tau, M, V = ctx.temperature, hidden.shape[0], weight.shape[0]
        bf16 = ctx.precision == "bf16"
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cols = max(1, min(V, ctx.block_elements // max(M, 1)))
        h = hidden.to(torch.bfloat16 if bf16 else weight.dtype)  # [M, H]
        w = weight.to(torch.bfloat16) if bf16 else weight  # [V, H]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [M, H]
        grad_w = _weight_grad_buffer(ctx.grad_into, weight) if need_w else None  # [V, H]
        in_place = grad_w is not None and ctx.grad_into is not None
        grad_b = torch.empty_like(bias) if need_b and bias is not None else None  # [V]
        go = grad_logp.float()[:, None]  # [M, 1]
        ge = (grad_ent.float()[:, None] if ctx.entropy_grad and grad_ent is not None
              else None)  # [M, 1]
        with torch.autocast(device_type=hidden.device.type, enabled=False), \
                matmul_precision(ctx.precision, hidden.device):
            for c in range(0, V, cols):
                w_c = w[c:c + cols]  # [v, H]
                z = _block_logits(h, w_c, None if bias is None else bias[c:c + cols], tau, bf16)
                # d logp / d z = onehot(tok) - p ; chain rule through z = (hW^T + b) / tau
                logp_c = z.sub_(lse[:, None])  # [M, v] log p (in z's buffer)
                g = torch.exp(logp_c)  # [M, v] p
                if ge is not None:  # dH/dz = -p (log p + H), in z's buffer
                    logp_c.add_(ent[:, None]).mul_(g).mul_(-ge)
                g.mul_(-go)  # [M, v]
                if ge is not None:
                    g.add_(logp_c)
                local = tokens - c  # [M] the token's column in this slice, if it lies there
                inside = (local >= 0) & (local < g.shape[1])
                g.scatter_add_(1, local.clamp(0, g.shape[1] - 1)[:, None],
                               torch.where(inside[:, None], go, 0.0))
                if tau != 1.0:
                    g.div_(tau)
                g = g.to(weight.dtype)
                if need_h and bf16:
                    grad_h.add_(mm_fp32_out(g, w_c))  # [M, H]
                elif need_h:
                    grad_h.addmm_(g.float(), w_c.float())  # [M, H]
                if grad_w is not None and bf16:
                    gw = mm_fp32_out(g.t(), h).to(grad_w.dtype)  # [v, H]
                    if in_place:
                        grad_w[c:c + cols].add_(gw)  # added to .grad
                    else:
                        grad_w[c:c + cols] = gw
                elif in_place:
                    grad_w[c:c + cols].addmm_(g.t(), h)  # [v, H] added to .grad
                elif grad_w is not None:
                    grad_w[c:c + cols] = g.t() @ h  # [v, H]
                if grad_b is not None:
                    grad_b[c:c + cols] = g.sum(0).to(grad_b.dtype)
            return (grad_h.to(hidden.dtype) if need_h else None), None if in_place else grad_w, \
            grad_b, None, None, None, None, None, None, None, None


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    block_elements: int | None = None,
    grad_in_place: bool = False,
    entropy_grad: bool = False,
    precision: str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token log-probs (and entropies) of a linear LM head, never materialising [.., V] logits.

    Args:
        hidden: [..., H] hidden states (any float dtype; cast to the weight's dtype per block).
        weight: [V, H] the LM head weight (fp32 recommended: fp32 logits); bias: [V] or None.
        tokens: [...] integer ids, aligned with `hidden` (hidden[i] predicts tokens[i]).
        temperature: logits are divided by it (the sampling temperature).
        with_entropy: also return the entropy in nats of each row's distribution.
        entropy_grad: make that entropy differentiable (PPO's entropy bonus); else detached.
        block_elements: fp32 elements of one logits block; bounds the extra memory. None:
            by device (`device_block_elements`).
        grad_in_place: when `weight` is a trainable leaf (an ``nn.Parameter``), the backward
            adds grad_W straight into ``weight.grad`` (created if None) instead of returning a
            new ``[V, H]`` tensor for autograd to accumulate: one ``[V, H]`` fp32 tensor less at
            the peak of every backward after the first micro-batch. ``.grad`` is complete when
            ``backward()`` returns; ``torch.autograd.grad`` and gradient hooks on `weight` do
            not see this part.
        precision: fp32 (the weight's dtype), tf32 (TF32 matmuls on CUDA; fp32 elsewhere) or
            bf16 (bf16 inputs, fp32 accumulation and logits); None: the enclosing
            `head_precision` context's, fp32 outside one.

    Returns:
        logprobs [...] fp32, differentiable w.r.t. hidden, weight and bias; entropy [...] fp32
        (differentiable only with `entropy_grad`) or None.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"head_logprobs: hidden {tuple(hidden.shape)} must be tokens "
                         f"{tuple(tokens.shape)} plus a trailing hidden dim")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"head_logprobs: weight must be [V, {hidden.shape[-1]}], "
                         f"got {tuple(weight.shape)}")
    precision = current_head_precision() if precision is None else precision
    if precision not in HEAD_PRECISIONS:
        raise ValueError(f"head_logprobs: precision {precision!r}, expected one of "
                         f"{HEAD_PRECISIONS}")
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [M, H]
    if block_elements is None:
        block_elements = block_elements_for(h2.device)
    rows = block_rows(h2.shape[0], weight.shape[0], block_elements)
    into = (weight if grad_in_place and weight.requires_grad and weight.is_leaf
            and type(weight) is torch.nn.Parameter else None)
    logp, ent = _HeadLogprobs.apply(h2, weight, bias, tokens.reshape(-1).long(),
                                    float(temperature), rows, bool(with_entropy),
                                    int(block_elements), into, bool(entropy_grad), precision)
    return logp.view(tokens.shape), (ent.view(tokens.shape) if with_entropy else None)
