"""Learned rewards: a trained ORM or PRM used anywhere a reward function is.

Recipe entries: ``{name: reward_model, path: DIR}`` and ``{name: process_reward_model, path:
DIR, aggregate: min}`` (extra keys go to the reward model). Each reward model loads its OWN model
and tokenizer from ``path`` once per process (cached by path, device and dtype) and scores a batch
without gradients; ``device: auto`` picks cuda when available; ``path`` is checked (a
*ForSequenceClassification / *ForTokenClassification config.json) before any model loads.
* ``reward_model``: the ORM's scalar score (a logit; ``transform: sigmoid`` maps it to (0, 1)).
* ``process_reward_model``: the PRM's step scores aggregated (``aggregate``: ``min`` by default,
  ``prod``, ``last``, ``mean``), steps cut by the PRM's saved rule.
Both are the library's one reward-model path (:mod:`posttrain.models.reward_models`), so a PRM
scores the same here as in process supervision and search. torch is imported only when a
reward model is built.
More: docs/rewards.md, "Module notes", posttrain.rewards.learned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _prompts(rows: Sequence[dict[str, Any]]) -> list[Any]:
    missing = [i for i, r in enumerate(rows) if "prompt" not in r]
    if missing:
        raise ValueError(f"learned reward: sample {missing[0]} has no 'prompt' field")
    return [r["prompt"] for r in rows]


def reward_model_reward(completions: Sequence[str], rows: Sequence[dict[str, Any]], *,
                        path: str, transform: str = "raw", device: str = "auto",
                        dtype: str = "float32") -> list[float]:
    """Batched ORM reward: the scalar score of each completion (see the module doc)."""
    from posttrain.models.reward_models import get_reward_model

    orm = get_reward_model(path, "orm", device, dtype)
    return orm.score(_prompts(rows), completions, transform)


def process_reward_model_reward(completions: Sequence[str], rows: Sequence[dict[str, Any]], *,
                                path: str, aggregate: str | None = None, device: str = "auto",
                                dtype: str = "float32") -> list[float]:
    """Batched PRM reward: aggregated step scores of each completion (see the module doc);
    ``aggregate=None`` is the reward model's default (``min``)."""
    from posttrain.models.reward_models import DEFAULT_AGGREGATE, get_reward_model

    return get_reward_model(path, "prm", device, dtype).score(_prompts(rows), completions,
                                                        aggregate or DEFAULT_AGGREGATE)


def _validate(kind: str, choices: dict[str, str | None]) -> Any:
    """The recipe check of a learned reward; ``choices`` maps each allowed key to the name of
    its valid values in ``posttrain.models.reward_models`` (None: any value)."""
    def check(kwargs: dict[str, Any]) -> None:
        from posttrain.models import reward_models
        from posttrain.models.reward import check_reward_model_dir

        name = "reward_model" if kind == "orm" else "process_reward_model"
        unknown = sorted(set(kwargs) - set(choices) - {"path"})
        if unknown:
            raise ValueError(f"reward {name!r}: unknown key(s) {unknown}; valid: "
                             f"{['path', *choices]}")
        if not isinstance(kwargs.get("path"), str) or not kwargs["path"]:
            raise ValueError(f"reward {name!r}: key 'path' is required (a directory saved by "
                             f"`posttrain {'rm' if kind == 'orm' else 'prm'}`)")
        for key, attr in choices.items():
            valid = getattr(reward_models, attr) if attr else None
            if valid is not None and key in kwargs and kwargs[key] not in valid:
                raise ValueError(f"reward {name!r}: {key}={kwargs[key]!r}; valid: {list(valid)}")
        try:
            check_reward_model_dir(kwargs["path"], kind)
        except ValueError as err:
            raise ValueError(f"reward {name!r}: {err}") from err

    return check


reward_model_reward.batched = True  # type: ignore[attr-defined]
reward_model_reward.validate_kwargs = _validate(  # type: ignore[attr-defined]
    "orm", {"transform": "TRANSFORMS", "device": None, "dtype": None})
process_reward_model_reward.batched = True  # type: ignore[attr-defined]
process_reward_model_reward.validate_kwargs = _validate(  # type: ignore[attr-defined]
    "prm", {"aggregate": "AGGREGATIONS", "device": None, "dtype": None})
