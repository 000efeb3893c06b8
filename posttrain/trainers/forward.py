"""Forward passes that turn (prompt, completion) token batches into per-token log-probs.

Shared by every trainer. Logits come from the model's own forward inside
`posttrain.rollout.logits.logits_context`, exactly as in the sampler, so family-specific logit
transforms (Gemma-2 softcapping, Granite/Cohere logit scaling) apply to both. Two things make it
cheap: columns that are padding in every row of the micro-batch are cut before the forward pass,
and ``logits_to_keep`` runs the LM head only on the positions that predict completion tokens.
Under bf16 autocast the transformer body runs in bf16 while the LM head and the log-softmax stay
in the head's weight dtype (fp32), so log-probs (and hence ratios and KL) stay accurate.

Notation: n sequences in a micro-batch, P prompt tokens (left padded), T completion tokens (right
padded), V vocabulary, H hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.ops import entropy_from_logits, token_logprobs
from posttrain.rollout.logits import logits_context


def _trim(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
          response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cut all-padding columns: leading prompt columns and trailing completion columns."""
    keep_p = prompt_mask.any(0)
    first = int(keep_p.nonzero()[0]) if bool(keep_p.any()) else prompt_mask.shape[1] - 1
    keep_c = response_mask.any(0)
    last = int(keep_c.nonzero()[-1]) + 1 if bool(keep_c.any()) else 1
    return (prompt_ids[:, first:], prompt_mask[:, first:], completion_ids[:, :last],
            response_mask[:, :last])


def completion_logits(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    response_mask: Tensor,
    autocast: bool = False,
) -> Tensor:
    """Logits at the positions that predict each completion token.

    Args:
        prompt_ids, prompt_mask: [n, P] left padded; completion_ids, response_mask: [n, T].
    Returns:
        logits [n, T', V] with T' <= T (trailing all-padding columns removed); logits[:, t]
        predicts completion_ids[:, t].
    """
    p_ids, p_mask, c_ids, c_mask = _trim(prompt_ids, prompt_mask, completion_ids, response_mask)
    ids = torch.cat([p_ids, c_ids], dim=1)  # [n, P'+T']
    attn = torch.cat([p_mask, c_mask], dim=1).long()  # [n, P'+T']
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P'+T']
    T = c_ids.shape[1]
    with logits_context(model, autocast, ids.device):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                       logits_to_keep=T + 1).logits  # [n, T'+1, V]
    return logits[:, :-1].float()  # no copy when the head is fp32


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    autocast: bool = False,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and optionally entropies) of the completion tokens.

    Returns:
        logprobs [n, T] fp32 (padded back to the input width, 0 past the trimmed columns) and
        entropy [n, T] (detached) or None.
    """
    logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, response_mask,
                               autocast)  # [n, T', V]
    T_full, T = completion_ids.shape[1], logits.shape[1]
    logprobs = token_logprobs(logits, completion_ids[:, :T], temperature=temperature)  # [n, T']
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach(), temperature=temperature)  # [n, T']
    if T < T_full:
        pad = (0, T_full - T)
        logprobs = torch.nn.functional.pad(logprobs, pad)
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, pad)
    return logprobs, entropy


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    response_mask: Tensor,
    micro_batch_size: int,
    temperature: float = 1.0,
    autocast: bool = False,
) -> Tensor:
    """No-grad log-probs over a large batch in micro-batches. Returns [N, T] fp32."""
    out = []
    for start in range(0, prompt_ids.shape[0], micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        lp, _ = completion_logprobs(model, prompt_ids[sl], prompt_mask[sl], completion_ids[sl],
                                    response_mask[sl], temperature, autocast)
        out.append(lp)
    return torch.cat(out)
