"""The one record that passes from sampler to scorer to learner.

Notation: B prompts, G samples per prompt, N = B*G sequences, P prompt tokens (left padded),
T completion tokens (right padded).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


@dataclass
class Rollout:
    """A batch of sampled completions and everything the learner needs about them.

    Sequences are group-contiguous: rows ``g*G .. g*G+G-1`` share prompt ``g``.
    """

    prompt_ids: Tensor
    """[N, P] prompt tokens, left padded."""
    prompt_mask: Tensor
    """[N, P] bool, True on real prompt tokens."""
    completion_ids: Tensor
    """[N, T] sampled tokens, right padded (the EOS token, when sampled, is included)."""
    response_mask: Tensor
    """[N, T] bool, True where the completion token counts (up to and including EOS)."""
    logprobs: Tensor
    """[N, T] fp32 log-probs of the sampled tokens under the sampler at `temperature`
    (full distribution, before top-k/top-p truncation); 0 on masked positions."""
    truncated: Tensor
    """[N] bool, True where the completion hit max_new_tokens without EOS."""
    group_size: int
    completions: list[str] = field(default_factory=list)
    """N decoded completion texts (special tokens removed)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """N dataset rows (the prompt's row, repeated for each of its G samples)."""
    scores: Tensor | None = None
    """[N] fp32 sequence scores (weighted reward sum); NaN marks an unscorable sample."""
    advantages: Tensor | None = None
    """[N] or [N, T] advantages."""
    old_logprobs: Tensor | None = None
    """[N, T] log-probs of the policy that generated the batch, for off-policy updates."""
    ref_logprobs: Tensor | None = None
    """[N, T] reference-model log-probs (only when a KL term is used)."""
    step_ends: Tensor | None = None
    """[N, S] long: token index in [0, T) where step j of completion i ends, -1 on padding
    steps (process supervision, `advantage: grpo_process`; None otherwise)."""
    step_scores: Tensor | None = None
    """[N, S] fp32: the process reward model's score of each step, 0 on padding steps."""
    is_weights: Tensor | None = None
    """[N, T] fp32 rollout-correction weights (`rollout_is`; None when off): exactly 0 on
    masked tokens and on tokens the correction rejects, > 0 on the tokens that count."""

    @property
    def num_sequences(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def completion_lengths(self) -> Tensor:
        """[N] number of counted completion tokens."""
        return self.response_mask.sum(-1)

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor field on `device` (fields already there are kept,
        not copied)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), Tensor)}
        return replace(self, **moved)

    def devices(self) -> set[torch.device]:
        """The devices its tensor fields are on."""
        return {v.device for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)}

    def select(self, index: Tensor | list[int]) -> Rollout:
        """Rows `index` of every per-sequence field (a view for mini-batching or filtering)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        ids = idx.tolist()

        def take(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[idx.to(x.device)]

        return Rollout(
            prompt_ids=take(self.prompt_ids),
            prompt_mask=take(self.prompt_mask),
            completion_ids=take(self.completion_ids),
            response_mask=take(self.response_mask),
            logprobs=take(self.logprobs),
            truncated=take(self.truncated),
            group_size=self.group_size,
            completions=[self.completions[i] for i in ids] if self.completions else [],
            rows=[self.rows[i] for i in ids] if self.rows else [],
            scores=take(self.scores),
            advantages=take(self.advantages),
            old_logprobs=take(self.old_logprobs),
            ref_logprobs=take(self.ref_logprobs),
            step_ends=take(self.step_ends),
            step_scores=take(self.step_scores),
            is_weights=take(self.is_weights),
        )


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Concatenate rollouts (e.g. DAPO refills), padding prompts left and completions right."""
    if len(parts) == 1:
        return parts[0]
    P = max(r.prompt_ids.shape[1] for r in parts)
    T = max(r.completion_ids.shape[1] for r in parts)

    def pad(x: Tensor, width: int, left: bool, value: float | int | bool) -> Tensor:
        extra = width - x.shape[1]
        if extra == 0:
            return x
        filler = torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)
        return torch.cat([filler, x] if left else [x, filler], dim=1)

    def cat_opt(name: str, width: int | None, value: float | int = 0) -> Tensor | None:
        vals = [getattr(r, name) for r in parts]
        if any(v is None for v in vals):
            return None
        if width is None or vals[0].dim() == 1:
            return torch.cat(vals)
        return torch.cat([pad(v, width, False, value) for v in vals])

    S = max((r.step_ends.shape[1] for r in parts if r.step_ends is not None), default=0)

    return Rollout(
        prompt_ids=torch.cat([pad(r.prompt_ids, P, True, pad_token_id) for r in parts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, P, True, False) for r in parts]),
        completion_ids=torch.cat([pad(r.completion_ids, T, False, pad_token_id) for r in parts]),
        response_mask=torch.cat([pad(r.response_mask, T, False, False) for r in parts]),
        logprobs=torch.cat([pad(r.logprobs, T, False, 0.0) for r in parts]),
        truncated=torch.cat([r.truncated for r in parts]),
        group_size=parts[0].group_size,
        completions=[c for r in parts for c in r.completions],
        rows=[row for r in parts for row in r.rows],
        scores=cat_opt("scores", None),
        advantages=cat_opt("advantages", T),
        old_logprobs=cat_opt("old_logprobs", T),
        ref_logprobs=cat_opt("ref_logprobs", T),
        step_ends=cat_opt("step_ends", S, -1),
        step_scores=cat_opt("step_scores", S, 0.0),
        is_weights=cat_opt("is_weights", T, 0.0),
    )
