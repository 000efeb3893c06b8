"""Rollout correction: importance weights for the gap between the sampler and the learner.

The sampler's log-probs q differ slightly from the learner's pi_old, so the detached ratio
``r[i,t] = exp(logp_old - logp_q)`` reweights each token's loss (truncated IS; Yao et al. 2025).
Notation: N sequences, T completion tokens; ``m`` = response_mask (True = counts).
Modes (``rollout_is``; cap C = ``rollout_is_cap``), R_i = exp(sum_t m (logp_old - logp_q)):
``none`` w = 1; ``token_truncate`` min(r, C); ``token_mask`` r, tokens with r > C leave the loss;
``sequence_truncate`` min(R_i, C); ``sequence_mask`` R_i, sequences with R_i > C leave the loss.
"Leave the loss": out of the numerator AND the normalisers. Masked slots never enter R_i, the
weights or the metrics; log-ratios clamped to [-20, 20]; a NaN sampler log-prob counts as
ratio 1 (as TRL). Metrics ``rollout/*``: ``logprob_abs_diff``, ``k3``, ``is_mean``,
``is_clipfrac``, ``ess``, ``nan_frac``.
More: docs/algorithms.md, "Module notes", posttrain.ops.importance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.ops.kl import kl_penalty
from posttrain.ops.masked import as_bool_mask, keep, masked_mean

IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOG_RATIO_CLAMP = 20.0


def rollout_log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor,
                      level: str = "token") -> Tensor:
    """log r: [N, T] per token (0 on masked slots and where the sampler's log-prob is NaN), or
    [N] per sequence (sum over real tokens)."""
    mask = as_bool_mask(response_mask)
    d = keep(old_logprobs - _sampler(old_logprobs, rollout_logprobs), mask)  # [N, T]
    if level == "sequence":
        d = d.sum(-1)  # [N]
    return d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _sampler(old_logprobs: Tensor, rollout_logprobs: Tensor) -> Tensor:
    """[N, T] log q with NaN replaced by log pi_old (ratio 1 there)."""
    return torch.where(rollout_logprobs.isnan(), old_logprobs, rollout_logprobs)


def _level(mode: str) -> str:
    if mode not in IS_MODES:
        raise ValueError(f"unknown rollout_is mode {mode!r}; valid: {list(IS_MODES)}")
    return "sequence" if mode.startswith("sequence") else "token"


@torch.no_grad()
def rollout_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor,
                    mode: str = "none", cap: float = 3.0) -> tuple[Tensor, Tensor]:
    """Per-token importance weights and the tokens that stay in the loss.

    Args:
        old_logprobs: [N, T] log pi_old (the learner's forward of the rollout's policy).
        rollout_logprobs: [N, T] log q (the sampler's log-probs, `Rollout.logprobs`).
        response_mask: [N, T] True on real completion tokens.
        mode: one of ``IS_MODES`` (module docstring).
        cap: C > 0, the truncation / rejection threshold.

    Returns:
        (weights [N, T] fp32, 0 on masked and rejected slots; kept [N, T] bool: response_mask
        without the rejected tokens or sequences).
    """
    if cap <= 0:
        raise ValueError(f"rollout_is_cap must be > 0, got {cap}")
    mask = as_bool_mask(response_mask)
    level = _level(mode)
    if mode == "none":
        return mask.float(), mask
    log_r = rollout_log_ratio(old_logprobs, rollout_logprobs, mask, level)  # [N, T] or [N]
    if level == "sequence":
        log_r = log_r.unsqueeze(-1).expand(mask.shape)  # [N, T] R_i on every token
    ratio = torch.exp(log_r.float())  # [N, T]
    if mode.endswith("truncate"):
        return keep(ratio.clamp(max=cap), mask), mask
    kept = mask & (ratio <= cap)  # [N, T]
    return keep(ratio, kept), kept


@torch.no_grad()
def rollout_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor,
                    mode: str = "none", cap: float = 3.0) -> dict[str, Tensor]:
    """The sampler/learner gap: ``rollout/*`` metrics over real tokens (module docstring)."""
    mask = as_bool_mask(response_mask)
    level = _level(mode)
    nan = rollout_logprobs.isnan() & mask  # [N, T]
    rollout_logprobs = _sampler(old_logprobs, rollout_logprobs)  # [N, T]
    diff = (old_logprobs - rollout_logprobs).float()  # [N, T]
    k3 = kl_penalty(rollout_logprobs.float(), old_logprobs.float(), kind="k3", clamp=None)
    if level == "sequence":
        real = mask.any(-1)  # [N] sequences with a real token
        ratio = torch.exp(rollout_log_ratio(old_logprobs, rollout_logprobs, mask, level))[real]
    else:
        ratio = torch.exp(rollout_log_ratio(old_logprobs, rollout_logprobs, mask))[mask]
    ratio = ratio.float()  # [n] the ratios at the mode's level
    n = ratio.numel()
    ess = ratio.sum() ** 2 / (n * (ratio * ratio).sum()) if n else ratio.new_ones(())
    return {
        "rollout/logprob_abs_diff": masked_mean(diff.abs(), mask),
        "rollout/k3": masked_mean(k3, mask),
        "rollout/is_mean": ratio.mean() if n else ratio.new_ones(()),
        "rollout/is_clipfrac": (ratio > cap).float().mean() if n else ratio.new_zeros(()),
        "rollout/ess": ess,
        "rollout/nan_frac": masked_mean(nan.float(), mask),
    }

