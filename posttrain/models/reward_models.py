"""The one ORM / PRM path: a saved reward model scores completions the same way everywhere.

Used by the learned rewards, process supervision and test-time search, so the same PRM gives the
same score in each. Inputs are formatted as the trainers formatted them; no gradients; batched
(``batch_size`` sequences per forward pass) on the model's device.
* :class:`OutcomeRewardModel`: ``render(prompt) + completion + turn end``, scored at the last
  real token;
  ``transform="raw"`` (the logit, as TRL / OpenRLHF) or ``"sigmoid"`` (in (0, 1)).
* :class:`ProcessRewardModel`: steps cut by the PRM's OWN saved rule (``posttrain_prm.split``, wins
  over a recipe's separator), written with its saved separator; each step scores P(good) at its
  separator; the completion's score aggregates them (``min`` default, the weakest step;
  ``prod``, ``last``, ``mean``). A completion without any step is not sent to the model and
  scores ``EMPTY_SCORE`` = 0.0, the worst P(good).
More: docs/reward_models.md, "Module notes", posttrain.models.reward_models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.core.device import resolve_device
from posttrain.data.prompts import close_turn, render_prompt, turn_end_id
from posttrain.data.steps import split_steps, step_spans
from posttrain.models.reward import (
    encode_steps,
    load_reward_model,
    pad_right,
    prm_meta,
    sequence_scores,
    token_logits,
)
from posttrain.ops.prm import STEP_AGGREGATIONS, aggregate_step_scores, step_scores_from_logits

AGGREGATIONS = tuple(STEP_AGGREGATIONS)
DEFAULT_AGGREGATE = "min"
EMPTY_SCORE = 0.0
TRANSFORMS = ("raw", "sigmoid")
StepScoreFn = Callable[[Sequence[Any], Sequence[Sequence[str]]], list[list[float]]]
_CACHE: dict[tuple[str, str, str, str], Any] = {}


class _RewardModel:
    """What the ORM and the PRM share: the model, its tokenizer, loading and batching."""

    kind = ""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 64) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @classmethod
    def load(cls, path: str | Path, device: str = "auto", dtype: str = "float32",
             batch_size: int = 64) -> Any:
        """The reward model saved at ``path`` (its kind checked before any weight loads)."""
        model, tokenizer = load_reward_model(path, cls.kind, dtype)
        model.to(resolve_device(str(device))).eval().requires_grad_(False)
        return cls(model, tokenizer, batch_size)

    def render(self, prompt: Any) -> str:
        return render_prompt(self.tokenizer, prompt)

    def _batches(self, seqs: list[list[int]]) -> Iterator[tuple[Tensor, Tensor]]:
        """Right-padded ``(ids [n, T], mask [n, T])`` batches on the model's device."""
        device = next(self.model.parameters()).device
        for start in range(0, len(seqs), self.batch_size):
            ids, mask = pad_right(seqs[start:start + self.batch_size], self.pad)
            yield ids.to(device), mask.to(device)


class OutcomeRewardModel(_RewardModel):
    """A saved ORM: ``score(prompts, completions) -> [float]``."""

    kind = "orm"

    @torch.no_grad()
    def score(self, prompts: Sequence[Any], completions: Sequence[str],
              transform: str = "raw") -> list[float]:
        """One score per completion, read at the last real token of ``prompt + completion``
        closed by the turn's end token, as the ORM trained (`closed_ids`; a logit, its sigmoid
        with ``transform="sigmoid"``)."""
        if transform not in TRANSFORMS:
            raise ValueError(f"transform={transform!r}; valid: {list(TRANSFORMS)}")
        tok = self.tokenizer
        end = turn_end_id(tok)
        texts = [self.render(p) + c for p, c in zip(prompts, completions, strict=True)]
        if not texts:
            return []
        seqs = [close_turn(ids, end) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
        self.model.eval()
        scores = torch.cat([sequence_scores(self.model, ids, mask).cpu()
                            for ids, mask in self._batches(seqs)])  # [n]
        return (torch.sigmoid(scores) if transform == "sigmoid" else scores).tolist()

    __call__ = score


class ProcessRewardModel(_RewardModel):
    """A saved PRM: per-step scores P(good) and their aggregation (see the module doc).

    Called as ``scorer(prompts, steps)`` it is a search step scorer (:meth:`score_steps`).
    """

    kind = "prm"

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 64) -> None:
        super().__init__(model, tokenizer, batch_size)
        self.meta = prm_meta(model)

    def spans(self, completion: str) -> list[tuple[int, int]]:
        """Character spans of the steps of ``completion`` by the PRM's saved rule."""
        return step_spans(completion, self.meta["split"])

    def split(self, completion: str) -> list[str]:
        """The steps of ``completion`` by the PRM's saved rule (``posttrain_prm.split``)."""
        return split_steps(completion, self.meta["split"])

    @torch.no_grad()
    def score_steps(self, prompts: Sequence[Any], steps: Sequence[Sequence[str]]
                    ) -> list[list[float]]:
        """P(good) of every step of each (possibly partial) solution given as a step list."""
        encoded = [encode_steps(self.tokenizer, self.render(p), list(s), self.meta["separator"])
                   for p, s in zip(prompts, steps, strict=True)]
        self.model.eval()
        probs = []
        for ids, mask in self._batches([e[0] or [self.pad] for e in encoded]):
            probs += list(step_scores_from_logits(token_logits(self.model, ids, mask)).cpu())
        return [p[ends].tolist() for p, (_, ends) in zip(probs, encoded, strict=True)]

    __call__ = score_steps

    def step_scores(self, prompts: Sequence[Any], completions: Sequence[str]
                    ) -> list[list[float]]:
        """Per-step scores of each completion, steps cut by :meth:`split` (an empty list when
        it has no step)."""
        return scores_of_steps(self.score_steps, prompts, [self.split(c) for c in completions])

    def score(self, prompts: Sequence[Any], completions: Sequence[str],
              aggregate: str = DEFAULT_AGGREGATE) -> list[float]:
        """One score per completion: its step scores aggregated (``EMPTY_SCORE`` without steps)."""
        return outcome_from_steps(self.score_steps, prompts, completions, self.split, aggregate)


def aggregate_scores(step_scores: Sequence[Sequence[float]],
                     how: str = DEFAULT_AGGREGATE) -> list[float]:
    """``posttrain.ops.aggregate_step_scores`` over ragged lists of step scores; a solution
    without a step scores ``EMPTY_SCORE``."""
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregate={how!r}; valid: {list(AGGREGATIONS)}")
    if not step_scores:
        return []
    S = max(1, max(len(s) for s in step_scores))
    scores = torch.tensor([list(s) + [1.0] * (S - len(s)) for s in step_scores])  # [B, S]
    mask = torch.tensor([[j < len(s) for j in range(S)] for s in step_scores])  # [B, S]
    out = aggregate_step_scores(scores, mask, how)  # [B]
    return torch.where(mask.any(-1), out, EMPTY_SCORE).tolist()


def scores_of_steps(score_steps: StepScoreFn, prompts: Sequence[Any],
                    steps: Sequence[Sequence[str]]) -> list[list[float]]:
    """``score_steps`` on the solutions that have a step (one batched call); ``[]`` for the
    others, which are not sent to the model. Every path to a PRM's step scores goes here, so
    one completion meets the same batch whichever path asks."""
    keep = [i for i, s in enumerate(steps) if s]
    out: list[list[float]] = [[] for _ in steps]
    if keep:
        scored = score_steps([prompts[i] for i in keep], [steps[i] for i in keep])
        for i, s in zip(keep, scored, strict=True):
            out[i] = list(s)
    return out


def outcome_from_steps(score_steps: StepScoreFn, prompts: Sequence[Any],
                       completions: Sequence[str], split: Callable[[str], list[str]],
                       aggregate: str = DEFAULT_AGGREGATE) -> list[float]:
    """Split each completion, score the steps of those that have any, aggregate."""
    if aggregate not in AGGREGATIONS:
        raise ValueError(f"aggregate={aggregate!r}; valid: {list(AGGREGATIONS)}")
    steps = [split(c) for c in completions]
    return aggregate_scores(scores_of_steps(score_steps, prompts, steps), aggregate)


def get_reward_model(path: str | Path, kind: str, device: str = "auto",
                     dtype: str = "float32") -> Any:
    """The process-wide cached :class:`OutcomeRewardModel` (``kind="orm"``) or
    :class:`ProcessRewardModel` (``"prm"``) saved at ``path``."""
    key = (str(path), kind, str(device), dtype)
    if key not in _CACHE:
        cls = {"orm": OutcomeRewardModel, "prm": ProcessRewardModel}[kind]
        _CACHE[key] = cls.load(path, device, dtype)
    return _CACHE[key]
