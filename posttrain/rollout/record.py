"""The one record that passes from sampler to rewards to learner.

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

    Sequences are group-contiguous: rows ``g*G .. g*G+G-1`` share prompt ``g``. A per-token
    field declares how it is padded when rollouts are joined (``metadata["pad"]``: the axis,
    P prompt / T completion / S steps, and the value); `select` and `concat_rollouts` go over
    every field, so a new field needs no other change.
    """

    prompt_ids: Tensor = field(metadata={"pad": ("P", "pad_token")})
    """[N, P] prompt tokens, left padded."""
    prompt_mask: Tensor = field(metadata={"pad": ("P", False)})
    """[N, P] bool, True on real prompt tokens."""
    completion_ids: Tensor = field(metadata={"pad": ("T", "pad_token")})
    """[N, T] sampled tokens, right padded (the EOS token, when sampled, is included)."""
    response_mask: Tensor = field(metadata={"pad": ("T", False)})
    """[N, T] bool, True where the completion token counts (up to and including EOS)."""
    logprobs: Tensor = field(metadata={"pad": ("T", 0.0)})
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
    advantages: Tensor | None = field(default=None, metadata={"pad": ("T", 0.0)})
    """[N] or [N, T] advantages."""
    old_logprobs: Tensor | None = field(default=None, metadata={"pad": ("T", 0.0)})
    """[N, T] log-probs of the policy that generated the batch, for off-policy updates."""
    ref_logprobs: Tensor | None = field(default=None, metadata={"pad": ("T", 0.0)})
    """[N, T] reference-model log-probs (only when a KL term is used)."""
    step_ends: Tensor | None = field(default=None, metadata={"pad": ("S", -1)})
    """[N, S] long: token index in [0, T) where step j of completion i ends, -1 on padding
    steps (process supervision, `advantage: grpo_process`; None otherwise)."""
    step_scores: Tensor | None = field(default=None, metadata={"pad": ("S", 0.0)})
    """[N, S] fp32: the process reward model's score of each step, 0 on padding steps."""
    is_weights: Tensor | None = field(default=None, metadata={"pad": ("T", 0.0)})
    """[N, T] fp32 rollout-correction weights (`rollout_is`; None when off): exactly 0 on
    masked tokens and on tokens the correction rejects, > 0 on the tokens that count."""
    values: Tensor | None = field(default=None, metadata={"pad": ("T", 0.0)})
    """[N, T] the critic's values of the sampled tokens before the update (PPO)."""
    returns: Tensor | None = field(default=None, metadata={"pad": ("T", 0.0)})
    """[N, T] GAE returns, the critic's targets (PPO)."""

    completion_mask: Tensor | None = field(default=None, metadata={"pad": ("T", False)})
    """[N, T] bool, True on every real completion token, the model's and the tool answers'
    (multi-turn episodes, `posttrain.rollout.episodes`); None: the same as `response_mask`."""
    episodes: list[dict[str, Any]] = field(default_factory=list)
    """N per-episode counts of a multi-turn rollout (turns, calls, errors, cut, tool tokens);
    empty for single-turn rollouts."""

    @classmethod
    def from_sequences(cls, prompts: list[list[int]], completions: list[list[int]],
                       logprobs: list[list[float]], truncated: list[bool], *, group_size: int,
                       pad_token_id: int, tokenizer: Any = None,
                       rows: list[dict[str, Any]] | None = None,
                       model_tokens: list[list[bool]] | None = None,
                       episodes: list[dict[str, Any]] | None = None,
                       texts: list[str] | None = None) -> Rollout:
        """The one way token lists become a `Rollout` (every sampler, every episode loop).

        N group-contiguous sequences: `prompts` (N id lists, left padded to P),
        `completions` and their `logprobs` (right padded to T with `pad_token_id` / 0),
        `truncated` (N); `rows`: N rows; `model_tokens` (multi-turn): True on the model's
        tokens, which alone are in `response_mask` (the rest only in `completion_mask`);
        `texts`: the N completions as rewards read them, else decoded with `tokenizer` (special
        tokens skipped) when given."""
        N, P = len(completions), max(map(len, prompts), default=0)
        T = max(map(len, completions), default=0)
        prompt_ids = torch.full((N, P), pad_token_id, dtype=torch.long)  # [N, P]
        prompt_mask = torch.zeros((N, P), dtype=torch.bool)
        completion_ids = torch.full((N, T), pad_token_id, dtype=torch.long)  # [N, T]
        completion_mask = torch.zeros((N, T), dtype=torch.bool)
        lps = torch.zeros((N, T))  # [N, T] fp32
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            prompt_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            prompt_mask[i, P - len(p):] = True
            completion_ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
            completion_mask[i, :len(c)] = True
            lps[i, :len(c)] = torch.tensor(logprobs[i], dtype=torch.float32)
        response_mask = completion_mask
        if model_tokens is not None:
            response_mask = torch.zeros((N, T), dtype=torch.bool)
            for i, m in enumerate(model_tokens):
                response_mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
        if texts is None:
            texts = (tokenizer.batch_decode(completions, skip_special_tokens=True)
                     if tokenizer is not None else [])
        return cls(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   response_mask=response_mask, logprobs=lps,
                   truncated=torch.tensor(truncated, dtype=torch.bool), group_size=group_size,
                   completions=texts, rows=rows or [{} for _ in range(N)],
                   completion_mask=completion_mask if model_tokens is not None else None,
                   episodes=episodes or [])

    @property
    def attention_mask(self) -> Tensor:
        """[N, T] the completion tokens the model reads (a forward's mask): `completion_mask`,
        else `response_mask`. Losses, KL and entropy use `response_mask` only."""
        return self.completion_mask if self.completion_mask is not None else self.response_mask

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

        def take(x: Any) -> Any:
            if isinstance(x, Tensor):
                return x[idx.to(x.device)]
            if isinstance(x, list):
                return [x[i] for i in ids] if x else []
            return x  # per-batch values (group_size)

        return Rollout(**{f.name: take(getattr(self, f.name)) for f in fields(self)})


def pad_id(tokenizer: Any, stops: list[int]) -> int:
    """The one padding id: the tokenizer's pad token, else the first stop id."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if not stops:
        raise ValueError("the tokenizer has neither a pad nor an EOS token and the model's "
                         "generation_config names no eos_token_id: set tokenizer.pad_token")
    return int(stops[0])


def concat_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Concatenate rollouts (e.g. DAPO refills): every field, per-token ones padded to the
    widest part (prompts on the left, completions and steps on the right, with the value their
    field declares)."""
    if len(parts) == 1:
        return parts[0]
    widths = {"P": max(r.prompt_ids.shape[1] for r in parts),
              "T": max(r.completion_ids.shape[1] for r in parts),
              "S": max((r.step_ends.shape[1] for r in parts if r.step_ends is not None),
                       default=0)}

    def pad(x: Tensor, axis: str, value: float | int | bool) -> Tensor:
        if x.dim() == 1 or x.shape[1] == widths[axis]:
            return x
        extra = widths[axis] - x.shape[1]
        filler = torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)
        return torch.cat([filler, x] if axis == "P" else [x, filler], dim=1)

    def join(f: Any) -> Any:
        vals = [getattr(r, f.name) for r in parts]
        if isinstance(vals[0], list):
            return [v for part in vals for v in part]
        if not isinstance(vals[0], Tensor) and vals[0] is not None:
            return vals[0]  # per-batch values (group_size)
        if any(v is None for v in vals):
            return None
        axis, value = f.metadata.get("pad", ("N", 0))
        value = pad_token_id if value == "pad_token" else value
        return torch.cat([pad(v, axis, value) for v in vals])

    return Rollout(**{f.name: join(f) for f in fields(Rollout)})
