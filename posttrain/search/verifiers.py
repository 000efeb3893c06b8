"""Trained reward models as search scorers: an ORM as an OutcomeScorer, a PRM as a StepScorer.

Both read a checkpoint written by ``posttrain rm`` / ``posttrain prm`` (see
``posttrain.models.reward``) and format their input exactly as those trainers do:

* ORM: ``render(prompt) + completion + EOS``, score read at the last real token. A model
  trained with the binary objective gives a logit; ``probability=True`` returns its sigmoid
  (P(correct)), which is what a weighted vote should add up.
* PRM: ``render(prompt) + step_1 + sep + step_2 + sep + ...`` with the separator saved in the
  PRM's config; the score of a step is P(good) at its separator token
  (:func:`posttrain.ops.prm.step_scores_from_logits`).

No gradients; batched (``batch_size`` sequences per forward pass); on the model's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from posttrain.search.scorers import OutcomeScorer, StepScorer


def _render(tokenizer: Any, prompt: Any) -> str:
    from posttrain.data.prompts import render_prompt

    return render_prompt(tokenizer, prompt)


def orm_scorer(model: Any, tokenizer: Any, *, batch_size: int = 256,
               probability: bool = True) -> OutcomeScorer:
    """An :class:`OutcomeScorer` from an ORM (``AutoModelForSequenceClassification``, 1 label)."""
    from posttrain.models.reward import pad_right, sequence_scores

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.no_grad()
    def score(prompts: Sequence[Any], completions: Sequence[str]) -> list[float]:
        model.eval()
        device = next(model.parameters()).device
        texts = [_render(tokenizer, p) + c for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start:start + batch_size], add_special_tokens=False)
            ids, mask = pad_right([x + eos for x in enc["input_ids"]], pad)  # [n, T]
            r = sequence_scores(model, ids.to(device), mask.to(device))  # [n]
            out += (torch.sigmoid(r) if probability else r).tolist()
        return out

    return score


def prm_scorer(model: Any, tokenizer: Any, *, batch_size: int = 256) -> StepScorer:
    """A :class:`StepScorer` from a PRM (``AutoModelForTokenClassification``, 2 or 3 classes)."""
    from posttrain.models.reward import encode_steps, pad_right, prm_meta, token_logits
    from posttrain.ops.prm import step_scores_from_logits

    sep = prm_meta(model)["separator"]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.no_grad()
    def score(prompts: Sequence[Any], steps: Sequence[Sequence[str]]) -> list[list[float]]:
        model.eval()
        device = next(model.parameters()).device
        out: list[list[float]] = []
        for start in range(0, len(steps), batch_size):
            enc = [encode_steps(tokenizer, _render(tokenizer, p), list(s), sep)
                   for p, s in zip(prompts[start:start + batch_size],
                                   steps[start:start + batch_size], strict=True)]
            ids, mask = pad_right([e[0] for e in enc], pad)  # [n, T]
            probs = step_scores_from_logits(token_logits(model, ids.to(device),
                                                         mask.to(device))).cpu()  # [n, T]
            out += [probs[i, ends].tolist() for i, (_, ends) in enumerate(enc)]
        return out

    return score


def load_orm_scorer(path: str | Path, *, batch_size: int = 256, device: str = "cpu",
                    probability: bool = True) -> OutcomeScorer:
    """Load an ORM saved by ``posttrain rm`` (checked to be one before loading)."""
    from posttrain.models.reward import load_scorer

    model, tok = load_scorer(path, "orm")
    return orm_scorer(model.to(device), tok, batch_size=batch_size, probability=probability)


def load_prm_scorer(path: str | Path, *, batch_size: int = 256, device: str = "cpu"
                    ) -> StepScorer:
    """Load a PRM saved by ``posttrain prm`` (checked to be one before loading)."""
    from posttrain.models.reward import load_scorer

    model, tok = load_scorer(path, "prm")
    return prm_scorer(model.to(device), tok, batch_size=batch_size)
