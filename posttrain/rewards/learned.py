"""Learned rewards: a trained ORM or PRM used anywhere a reward function is.

Recipe entries (extra keys are passed to the scorer)::

    rewards:
      - {name: math, weight: 1.0}
      - {name: reward_model, path: runs/rm/final, weight: 0.5}
      - {name: process_reward_model, path: runs/prm/final, aggregate: min, weight: 0.5}

Each scorer loads its OWN model and tokenizer from ``path`` (so a reward model with another
vocabulary than the policy works), once per process (cached by path, device and dtype), and
scores a whole batch of completions without gradients. ``device: auto`` (the default, like the
trainers') puts it on cuda when available. The row's ``prompt`` is rendered with the scorer's
chat template. ``path`` is checked (config.json names a *ForSequenceClassification /
*ForTokenClassification checkpoint) when the recipe is validated, before any model loads.

* ``reward_model``: the ORM's scalar score (a logit; ``transform: sigmoid`` maps it to (0, 1)).
* ``process_reward_model``: the completion is split into steps with the PRM's saved rule, each
  step gets P(good), and ``aggregate`` (``min`` | ``prod`` | ``last`` | ``mean``) makes one score.
  :meth:`ProcessScorer.step_scores` returns the per-step scores for process supervision
  (e.g. ``posttrain.ops.process_advantages``) and :meth:`ProcessScorer.score_steps` scores
  partial solutions given as step lists (PRM beam search).

This module imports torch only when a scorer is built: ``posttrain.rewards`` stays torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

AGGREGATIONS = ("min", "prod", "last", "mean")
TRANSFORMS = ("raw", "sigmoid")
_CACHE: dict[tuple[str, str, str, str], Any] = {}


class OutcomeScorer:
    """A saved ORM: ``score(prompts, completions) -> [float]`` (batched, no gradients)."""

    kind = "orm"

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32",
                 batch_size: int = 64) -> None:
        from posttrain.models.reward import load_scorer
        from posttrain.trainers.session import resolve_device

        self.path, self.batch_size = path, batch_size
        self.model, self.tokenizer = load_scorer(path, self.kind, dtype)
        self.device = resolve_device(device)
        self.model.to(self.device).eval().requires_grad_(False)

    def _render(self, prompt: Any) -> str:
        from posttrain.data.prompts import render_prompt

        return render_prompt(self.tokenizer, prompt)

    def score(self, prompts: Sequence[Any], completions: Sequence[str]) -> list[float]:
        """Scalar scores, read at the last real token of ``prompt + completion + EOS``."""
        import torch

        from posttrain.models.reward import pad_right, sequence_scores

        tok = self.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        texts = [self._render(p) + c for p, c in zip(prompts, completions, strict=True)]
        seqs = [ids + eos for ids in tok(texts, add_special_tokens=False)["input_ids"]]
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        out: list[float] = []
        with torch.no_grad():
            for start in range(0, len(seqs), self.batch_size):
                ids, mask = pad_right(seqs[start:start + self.batch_size], pad)
                out += sequence_scores(self.model, ids.to(self.device),
                                       mask.to(self.device)).cpu().tolist()
        return out


class ProcessScorer(OutcomeScorer):
    """A saved PRM: per-step scores P(good) and their aggregation."""

    kind = "prm"

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32",
                 batch_size: int = 64) -> None:
        super().__init__(path, device, dtype, batch_size)
        from posttrain.models.reward import prm_meta

        self.meta = prm_meta(self.model)

    def split(self, completion: str) -> list[str]:
        """The steps of ``completion`` by the PRM's saved rule (``posttrain_prm.split``)."""
        from posttrain.tasks.step_labels import split_steps

        return split_steps(completion, self.meta["split"])

    def score_steps(self, prompts: Sequence[Any], steps: Sequence[Sequence[str]]
                    ) -> list[list[float]]:
        """P(good) of every step of each (possibly partial) solution given as a step list."""
        import torch

        from posttrain.models.reward import encode_steps, pad_right, token_logits
        from posttrain.ops import step_scores_from_logits

        encoded = [encode_steps(self.tokenizer, self._render(p), list(s), self.meta["separator"])
                   for p, s in zip(prompts, steps, strict=True)]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[list[float]] = []
        with torch.no_grad():
            for start in range(0, len(encoded), self.batch_size):
                part = encoded[start:start + self.batch_size]
                ids, mask = pad_right([e[0] or [pad] for e in part], pad)
                logits = token_logits(self.model, ids.to(self.device), mask.to(self.device))
                probs = step_scores_from_logits(logits).cpu()  # [n, T]
                out += [probs[k, ends].tolist() for k, (_, ends) in enumerate(part)]
        return out

    def step_scores(self, prompts: Sequence[Any], completions: Sequence[str]
                    ) -> list[list[float]]:
        """Per-step scores of each completion (an empty list when it has no step)."""
        return self.score_steps(prompts, [self.split(c) for c in completions])

    def score(self, prompts: Sequence[Any], completions: Sequence[str],
              aggregate: str = "min") -> list[float]:
        """One score per completion: its step scores aggregated (0.0 without steps)."""
        return aggregate_scores(self.step_scores(prompts, completions), aggregate)


def aggregate_scores(step_scores: Sequence[Sequence[float]], how: str = "min") -> list[float]:
    """``posttrain.ops.aggregate_step_scores`` over ragged lists of step scores."""
    import torch

    from posttrain.ops import aggregate_step_scores

    if how not in AGGREGATIONS:
        raise ValueError(f"aggregate={how!r}; valid: {list(AGGREGATIONS)}")
    if not step_scores:
        return []
    S = max(1, max(len(s) for s in step_scores))
    scores = torch.tensor([list(s) + [1.0] * (S - len(s)) for s in step_scores])  # [B, S]
    mask = torch.tensor([[j < len(s) for j in range(S)] for s in step_scores])  # [B, S]
    return aggregate_step_scores(scores, mask, how).tolist()


def get_scorer(path: str, kind: str, device: str = "auto", dtype: str = "float32") -> Any:
    """The cached :class:`OutcomeScorer` (``kind="orm"``) or :class:`ProcessScorer` (``"prm"``)."""
    key = (str(path), kind, device, dtype)
    if key not in _CACHE:
        cls = {"orm": OutcomeScorer, "prm": ProcessScorer}[kind]
        _CACHE[key] = cls(str(path), device=device, dtype=dtype)
    return _CACHE[key]


def _prompts(rows: Sequence[dict[str, Any]]) -> list[Any]:
    missing = [i for i, r in enumerate(rows) if "prompt" not in r]
    if missing:
        raise ValueError(f"learned reward: sample {missing[0]} has no 'prompt' field")
    return [r["prompt"] for r in rows]


def reward_model_reward(completions: Sequence[str], rows: Sequence[dict[str, Any]], *,
                        path: str, transform: str = "raw", device: str = "auto",
                        dtype: str = "float32") -> list[float]:
    """Batched ORM reward: the scalar score of each completion (see the module doc)."""
    import math

    scores = get_scorer(path, "orm", device, dtype).score(_prompts(rows), completions)
    if transform == "sigmoid":
        return [1.0 / (1.0 + math.exp(-s)) for s in scores]
    return scores


def process_reward_model_reward(completions: Sequence[str], rows: Sequence[dict[str, Any]], *,
                                path: str, aggregate: str = "min", device: str = "auto",
                                dtype: str = "float32") -> list[float]:
    """Batched PRM reward: aggregated step scores of each completion (see the module doc)."""
    return get_scorer(path, "prm", device, dtype).score(_prompts(rows), completions, aggregate)


def _validate(kind: str, allowed: dict[str, tuple[str, ...] | None]
              ) -> Any:
    def check(kwargs: dict[str, Any]) -> None:
        name = "reward_model" if kind == "orm" else "process_reward_model"
        unknown = sorted(set(kwargs) - set(allowed) - {"path"})
        if unknown:
            raise ValueError(f"reward {name!r}: unknown key(s) {unknown}; valid: "
                             f"{['path', *allowed]}")
        if not isinstance(kwargs.get("path"), str) or not kwargs["path"]:
            raise ValueError(f"reward {name!r}: key 'path' is required (a directory saved by "
                             f"`posttrain {'rm' if kind == 'orm' else 'prm'}`)")
        for key, choices in allowed.items():
            if choices is not None and key in kwargs and kwargs[key] not in choices:
                raise ValueError(f"reward {name!r}: {key}={kwargs[key]!r}; valid: {list(choices)}")
        from posttrain.models.reward import check_scorer_dir

        try:
            check_scorer_dir(kwargs["path"], kind)
        except ValueError as err:
            raise ValueError(f"reward {name!r}: {err}") from err

    return check


reward_model_reward.batched = True  # type: ignore[attr-defined]
reward_model_reward.validate_kwargs = _validate(  # type: ignore[attr-defined]
    "orm", {"transform": TRANSFORMS, "device": None, "dtype": None})
process_reward_model_reward.batched = True  # type: ignore[attr-defined]
process_reward_model_reward.validate_kwargs = _validate(  # type: ignore[attr-defined]
    "prm", {"aggregate": AGGREGATIONS, "device": None, "dtype": None})
