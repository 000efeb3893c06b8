"""Process supervision for GRPO: steps, their token positions and their scores.

`advantage: grpo_process` (DeepSeekMath section 4.1.3; docs/process_supervision.md) needs, per
sampled completion, where each step ends and a score per step, from a *step scorer*::

    scorer(prompts: list, completions: list[str])
        -> list[(char_ends: list[int], scores: list[float])]  # one pair per completion

`char_ends[j]`: the character offset (exclusive) where step `j` ends. :class:`PRMStepScorer`
(``process_reward_model: DIR``) runs the library's one PRM path with the PRM's OWN saved step
rule; ``package.module:name`` loads any other callable (or zero-argument factory) of that shape.
:func:`step_tensors` maps character ends to sampled-token positions; the LAST step extends to
the last counted token (EOS included); a stepless completion gets one step of ``EMPTY_SCORE``.
More: docs/process_supervision.md, "Module notes", posttrain.trainers.process_steps.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.models.reward_models import EMPTY_SCORE, get_reward_model

StepScorer = Callable[[Sequence[Any], Sequence[str]], list[tuple[list[int], list[float]]]]


class PRMStepScorer:
    """Step ends and P(good) per step from a PRM saved by ``posttrain prm``."""

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32") -> None:
        self.prm = get_reward_model(path, "prm", device, dtype)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str]
                 ) -> list[tuple[list[int], list[float]]]:
        spans = [self.prm.spans(c) for c in completions]
        scores = self.prm.step_scores(prompts, completions)
        return [([b for _, b in sp], sc) for sp, sc in zip(spans, scores, strict=True)]


def is_target(spec: str) -> bool:
    """True for a ``package.module:name`` target (not a PRM directory)."""
    return ":" in spec and not Path(spec).exists()


def check_process_reward_model(spec: str) -> None:
    """Raise ValueError (naming the config key) unless `spec` is a PRM dir or an importable
    target. Cheap: reads config.json or imports a module, loads no model."""
    key = "config key 'process_reward_model'"
    if not spec:
        raise ValueError(f"{key}: required with advantage=grpo_process (a directory saved by "
                         "`posttrain prm`, or 'package.module:step_scorer')")
    if is_target(spec):
        _load_target(spec)
        return
    from posttrain.models.reward import check_reward_model_dir

    try:
        check_reward_model_dir(spec, "prm")
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from err


def _load_target(spec: str) -> Any:
    module_name, _, name = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"config key 'process_reward_model'={spec!r}: cannot load it: "
                         f"{err}") from err
    if not callable(obj):
        raise ValueError(f"config key 'process_reward_model'={spec!r}: not callable")
    return obj


def build_step_scorer(spec: str, device: str = "auto", dtype: str = "float32") -> StepScorer:
    """The step scorer named by the config key `process_reward_model`."""
    if is_target(spec):
        obj = _load_target(spec)
        return obj() if isinstance(obj, type) else obj
    return PRMStepScorer(spec, device=device, dtype=dtype)


def token_ends(tokenizer: Any, ids: Sequence[int], char_ends: Sequence[int]) -> list[int]:
    """Token index of each step end for one completion's counted token ids.

    Token `t` ends the step whose last character it completes: the first `t` whose decoded
    prefix ``ids[:t+1]`` (special tokens removed, as the completion text) reaches the step's
    character end. The last step ends at the last token. Empty ``char_ends``: one step there.
    """
    n = len(ids)
    if n == 0:
        return []
    if not char_ends:
        return [n - 1]
    prefixes = tokenizer.batch_decode([list(ids[:t + 1]) for t in range(n)],
                                      skip_special_tokens=True)
    lengths = [len(p) for p in prefixes]
    out, t = [], 0
    for end in char_ends[:-1]:
        while t < n - 1 and lengths[t] < end:
            t += 1
        out.append(t)
    out.append(n - 1)
    return out


def step_tensors(tokenizer: Any, completion_ids: Tensor, response_mask: Tensor,
                 steps: Sequence[tuple[Sequence[int], Sequence[float]]]
                 ) -> tuple[Tensor, Tensor]:
    """Token positions and scores of every step, padded.

    Args:
        completion_ids: [N, T] sampled tokens (right padded). response_mask: [N, T] bool.
        steps: N pairs (character ends, scores) from a step scorer.

    Returns:
        (step_ends [N, S] long, -1 on padding steps; step_scores [N, S] fp32, 0 on padding).
        Every completion with a counted token has at least one step.
    """
    if len(steps) != completion_ids.shape[0]:
        raise ValueError(f"step scorer returned {len(steps)} results for "
                         f"{completion_ids.shape[0]} completions")
    ends_all, scores_all = [], []
    for i, (char_ends, scores) in enumerate(steps):
        if len(char_ends) != len(scores):
            raise ValueError(f"step scorer: completion {i} has {len(char_ends)} step ends but "
                             f"{len(scores)} scores")
        ids = completion_ids[i][response_mask[i]].tolist()
        ends = token_ends(tokenizer, ids, list(char_ends))
        vals = [float(s) for s in scores] if char_ends else [EMPTY_SCORE] * len(ends)
        ends_all.append(ends)
        scores_all.append(vals)
    S = max(1, max(len(e) for e in ends_all))
    step_ends = torch.full((len(steps), S), -1, dtype=torch.long)
    step_scores = torch.zeros((len(steps), S), dtype=torch.float32)
    for i, (e, v) in enumerate(zip(ends_all, scores_all, strict=True)):
        step_ends[i, :len(e)] = torch.tensor(e, dtype=torch.long)
        step_scores[i, :len(v)] = torch.tensor(v, dtype=torch.float32)
    return step_ends, step_scores


def annotate_dump(path: Path, scorer: StepScorer, prompts: Sequence[Any]) -> None:
    """Add each eval sample's steps and step scores to a JSONL dump (rewritten in place).

    Every row gets ``steps: [{"text", "score"}]`` and ``blamed_step``: the index of the
    lowest-scored step (the one a process advantage pushes down hardest), or null.
    """
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) != len(prompts):
        raise ValueError(f"{path}: {len(rows)} rows but {len(prompts)} prompts")
    results = scorer(prompts, [r["completion"] for r in rows])
    with path.open("w") as fh:
        for row, (ends, scores) in zip(rows, results, strict=True):
            starts = [0, *ends[:-1]]
            row["steps"] = [{"text": row["completion"][a:b].strip(" ;\n"), "score": round(s, 4)}
                            for a, b, s in zip(starts, ends, scores, strict=True)]
            row["blamed_step"] = (min(range(len(scores)), key=scores.__getitem__)
                                  if scores else None)
            fh.write(json.dumps(row, default=str) + "\n")
