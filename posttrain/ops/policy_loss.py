"""PPO-clip family policy loss at token / sequence level, and loss aggregation.

Notation: B prompts, G samples per prompt, N = B*G sequences, T response tokens, V vocab.

- Token ratio (PPO): ``rho = exp(logp - logp_old)``, ``L = -min(rho*A, clip(rho, 1-eps_low,
  1+eps_high)*A)`` (``eps_high > eps_low``: DAPO's clip-higher); optional dual clip for A < 0.
- Sequence ratio (GSPO): ``s_i = exp(mean_t m*(logp - logp_old))`` (``"product"``: exp of sum);
  GSPO-token: ``s[i,t] = sg(s_i) * exp(logp_t - sg(logp_t))``.
- Aggregation: ``seq-mean-token-mean`` (GRPO), ``token-mean`` (DAPO),
  ``seq-mean-token-sum-norm`` (Dr. GRPO).
Deliberate: a sequence-level loss is broadcast to its tokens and aggregated like the others; a
[N, T] advantage is reduced to its per-sequence masked mean there; log-ratios are clamped to
[-20, 20] before ``exp`` and zeroed on masked slots.
More (papers, equations): docs/algorithms.md, "Module notes", posttrain.ops.policy_loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.ops.masked import as_bool_mask, keep, masked_count, masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0
Count = int | float | Tensor | None


def _token_mean(per_token: Tensor, mask: Tensor, max_len: int | None, total_tokens: Count,
                total_seqs: Count) -> Tensor:
    denom = masked_count(mask) if total_tokens is None else total_tokens
    return masked_sum(per_token, mask) / denom  # []


def _num_seqs(mask: Tensor, total_seqs: Count) -> Tensor | int | float:
    """Sequences with at least one real token (fully padded rows do not count)."""
    return (masked_count(mask, dim=-1) > 0).sum() if total_seqs is None else total_seqs


def _seq_mean_token_mean(per_token: Tensor, mask: Tensor, max_len: int | None,
                         total_tokens: Count, total_seqs: Count) -> Tensor:
    seq_means = masked_mean(per_token, mask, dim=-1)  # [N]
    return seq_means.sum() / _num_seqs(mask, total_seqs)  # []


def _seq_mean_token_sum_norm(per_token: Tensor, mask: Tensor, max_len: int | None,
                             total_tokens: Count, total_seqs: Count) -> Tensor:
    length = per_token.shape[-1] if max_len is None else max_len
    return masked_sum(per_token, mask) / (_num_seqs(mask, total_seqs) * length)  # []


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "seq-mean-token-mean": _seq_mean_token_mean,
    "token-mean": _token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(
    per_token: Tensor,
    response_mask: Tensor,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    total_tokens: Count = None,
    total_seqs: Count = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar (GRPO, DAPO or Dr. GRPO; docs/algorithms.md).

    Args:
        per_token: [N, T] loss per token.
        response_mask: [N, T] True on real tokens.
        loss_agg: "seq-mean-token-mean" | "token-mean" | "seq-mean-token-sum-norm".
        max_len: Dr. GRPO's constant (configured max completion length); None uses T.
        total_tokens / total_seqs: real-token / sequence counts of the WHOLE optimizer step.
            When given they replace this micro-batch's counts, so summing the micro-batch
            losses of one gradient-accumulation step equals the loss of one big batch.
            (With DDP, which averages gradients over ranks, pass global counts and scale the
            loss by the world size.)

    Returns:
        [] scalar loss.
    """
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {sorted(LOSS_AGGREGATIONS)}")
    mask = as_bool_mask(response_mask)
    return LOSS_AGGREGATIONS[loss_agg](per_token, mask, max_len, total_tokens, total_seqs)


def _token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                     sequence_ratio: str) -> Tensor:
    return keep(logprobs - old_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]


def _sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                        sequence_ratio: str) -> Tensor:
    reducers = {"geometric": masked_mean, "product": masked_sum}
    if sequence_ratio not in reducers:
        raise ValueError(f"unknown sequence_ratio {sequence_ratio!r}; valid: {sorted(reducers)}")
    seq = reducers[sequence_ratio](logprobs - old_logprobs, mask, dim=-1)  # [N]
    seq = seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N]
    return seq.unsqueeze(-1).expand_as(logprobs)  # [N, T] s_i on every token


def _sequence_token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor,
                              sequence_ratio: str) -> Tensor:
    seq = _sequence_log_ratio(logprobs, old_logprobs, mask, sequence_ratio).detach()  # [N, T]
    own = keep(logprobs - logprobs.detach(), mask)  # [N, T] value 0, gradient d logp_t
    return seq + own  # [N, T] log s[i,t] = sg(log s_i) + logp_t - sg(logp_t)


RATIO_LEVELS: dict[str, Callable[..., Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
    "sequence_token": _sequence_token_log_ratio,
}


def _advantages_for(advantages: Tensor, mask: Tensor, ratio_level: str) -> Tensor:
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1).expand(mask.shape)  # [N, T]
    if ratio_level == "sequence":
        return masked_mean(advantages, mask, dim=-1, keepdim=True).expand(mask.shape)  # [N, T]
    return keep(advantages, mask)  # [N, T]


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    ratio_level: str = "token",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    sequence_ratio: str = "geometric",
    dual_clip: float | None = None,
    total_tokens: Count = None,
    total_seqs: Count = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped-surrogate policy loss (PPO eq. 7, GSPO arXiv:2507.18071; docs/algorithms.md).

    Args:
        logprobs: [N, T] log pi_theta (requires grad).
        old_logprobs: [N, T] log pi_old of the rollout (on-policy: ``logprobs.detach()``).
        advantages: [N, T] per token or [N] per sequence.
        response_mask: [N, T] True on real completion tokens.
        ratio_level: "token" (PPO/GRPO) | "sequence" (GSPO) | "sequence_token" (GSPO-token).
        eps_low / eps_high: clip range ``[1 - eps_low, 1 + eps_high]``.
        loss_agg, max_len, total_tokens, total_seqs: see ``aggregate_loss``.
        sequence_ratio: "geometric" (GSPO paper) | "product" (seed note 000).
        dual_clip: c > 1 enables dual clip for negative advantages (Ye et al. use 3).
        weights: [N, T] detached rollout-correction weights multiplying each token's clipped
            loss (``posttrain.ops.importance.rollout_weights``); None means 1 everywhere.

    Returns:
        (loss [], metrics) with detached "policy/clipfrac", "policy/approx_kl",
        "policy/ratio_mean", "policy/ratio_max", "policy/ratio_min" (and
        "policy/dual_clipfrac" when ``dual_clip`` is set). Ratio statistics are over real
        tokens of the ratio actually used (s_i repeated on each token at sequence level).
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {sorted(RATIO_LEVELS)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. use 3), got {dual_clip}")
    mask = as_bool_mask(response_mask)  # [N, T]
    log_ratio = RATIO_LEVELS[ratio_level](logprobs, old_logprobs, mask, sequence_ratio)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    adv = _advantages_for(advantages, mask, ratio_level)  # [N, T]
    unclipped = -adv * ratio  # [N, T]
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [N, T]
    per_token = torch.maximum(unclipped, clipped)  # [N, T] = -min(rho*A, clip(rho)*A)
    metrics: dict[str, Tensor] = {}
    if dual_clip is not None:
        cap = -dual_clip * adv  # [N, T]
        capped = (adv < 0) & (cap < per_token)  # [N, T]
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)  # [N, T]
        metrics["policy/dual_clipfrac"] = masked_mean(capped.float(), mask).detach()
    if weights is not None:
        per_token = per_token * weights.detach()  # [N, T] rollout correction
    loss = aggregate_loss(per_token, mask, loss_agg, max_len, total_tokens, total_seqs)
    metrics.update(_ratio_metrics(logprobs, old_logprobs, ratio, clipped > unclipped, mask))
    return loss, metrics


def _ratio_metrics(logprobs: Tensor, old_logprobs: Tensor, ratio: Tensor, was_clipped: Tensor,
                   mask: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        real = ratio[mask]  # [num real tokens]
        one = ratio.new_ones(())
        return {
            "policy/clipfrac": masked_mean(was_clipped.float(), mask),
            "policy/approx_kl": masked_mean(old_logprobs - logprobs, mask),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/ratio_max": real.max() if real.numel() else one,
            "policy/ratio_min": real.min() if real.numel() else one,
        }

