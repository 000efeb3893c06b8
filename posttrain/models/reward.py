"""Reward models: build, check, load and run outcome (ORM) and process (PRM) reward models.

Both are stock ``transformers`` heads on any causal LM, so ``from_pretrained`` loads what the
trainers save with no code of ours:
* ORM: ``AutoModelForSequenceClassification`` with ``num_labels=1`` (a linear ``score`` head);
  the score is read at the last real token from the attention mask (:func:`sequence_scores`),
  not by HF's pad-based pooling (wrong when pad == EOS); why this class over a value head: More.
* PRM: ``AutoModelForTokenClassification`` with ``num_labels`` = 2 or 3, read at step-end
  positions only (Lightman et al. 2023; class layout: ``posttrain.ops.prm``).
The PRM's step format is saved in its config.json under ``posttrain_prm``
(``{"separator": "\\n", "split": "think", "num_classes": 2}``), so a reward model formats
completions exactly as the trainer did. Notation: B sequences, T tokens, C classes, S steps.
More: docs/reward_models.md, "Module notes", posttrain.models.reward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.core.padding import count_positions
from posttrain.models.loading import ModelLoadError, load_tokenizer, resolve_dtype
from posttrain.models.packing import packed_outputs

KINDS: dict[str, tuple[str, str]] = {
    # kind -> (architecture suffix, human name)
    "orm": ("ForSequenceClassification", "an outcome reward model (posttrain rm)"),
    "prm": ("ForTokenClassification", "a process reward model (posttrain prm)"),
}
PRM_META_KEY = "posttrain_prm"


class RewardModelError(ValueError):
    """A path that is not a reward model of the kind asked for (raised before loading)."""


def _auto_class(kind: str) -> Any:
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    if kind not in KINDS:
        raise ValueError(f"unknown reward model kind {kind!r}; valid: {sorted(KINDS)}")
    return AutoModelForSequenceClassification if kind == "orm" else AutoModelForTokenClassification


def check_reward_model_dir(path: str | Path, kind: str) -> dict[str, Any]:
    """Read ``path/config.json`` and check it holds a reward model of ``kind``; return the config.

    Cheap (no weights read), so recipes fail before any model loads.
    """
    suffix, what = KINDS.get(kind, (None, None))
    if suffix is None:
        raise ValueError(f"unknown reward model kind {kind!r}; valid: {sorted(KINDS)}")
    cfg_path = Path(path) / "config.json"
    if not Path(path).is_dir() or not cfg_path.is_file():
        raise RewardModelError(f"reward model path {str(path)!r}: expected a directory with "
                          f"config.json holding {what}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise RewardModelError(f"{cfg_path}: not valid JSON ({err.msg})") from err
    archs = config.get("architectures") or []
    if not any(str(a).endswith(suffix) for a in archs):
        raise RewardModelError(f"reward model path {str(path)!r}: config.json architectures "
                               f"{archs} is not {what} (expected a *{suffix} checkpoint)")
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if kind == "orm" and labels != 1:
        raise RewardModelError(f"reward model path {str(path)!r}: num_labels={labels}, an outcome "
                          "reward model has exactly 1 (a scalar score)")
    if kind == "prm" and labels not in (2, 3):
        raise RewardModelError(f"reward model path {str(path)!r}: num_labels={labels}, a process "
                          "reward model has 2 or 3 step classes")
    return config


def build_reward_model(base: str | Path | torch.nn.Module, kind: str, tokenizer: Any,
                 num_labels: int = 1, dtype: str = "float32", dropout: float = 0.0) -> Any:
    """A reward model of ``kind`` whose decoder is ``base`` (a causal LM path or model object).

    The decoder weights are copied; the head (``score``) is new. ``pad_token_id`` is set from
    the tokenizer so HF's own pooling also works when pad != EOS. ``dropout`` sets the PRM
    head's ``classifier_dropout`` (HF's default is 0.1).
    """
    cls = _auto_class(kind)
    extra = {"classifier_dropout": dropout} if kind == "prm" else {}
    if isinstance(base, torch.nn.Module):
        from transformers import AutoConfig

        fields = {k: v for k, v in base.config.to_dict().items()
                  if k not in ("id2label", "label2id", "architectures")}
        config = AutoConfig.for_model(**{**fields, "num_labels": num_labels, **extra})
        model = cls.from_config(config)
        prefix = model.base_model_prefix
        decoder = getattr(base, prefix, None)
        if decoder is None:
            raise ModelLoadError(f"{type(base).__name__} has no '{prefix}' decoder to copy")
        getattr(model, prefix).load_state_dict(decoder.state_dict())
        model.to(next(base.parameters()).dtype)
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(base), num_labels=num_labels, **extra)
            model = cls.from_pretrained(str(base), config=config, dtype=resolve_dtype(dtype))
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"could not build a {kind} from {str(base)!r}: {err}") from err
    if not hasattr(model, "score"):
        raise ModelLoadError(f"{type(model).__name__} has no `score` head; posttrain's reward "
                             "models support decoders whose HF classification class names it "
                             "`score` (Llama, Qwen2, Mistral, Gemma, GPT-2, ...)")
    model.config.pad_token_id = tokenizer.pad_token_id
    if kind == "prm":  # transformers 5 drops a config key its class lacks (0.1 otherwise)
        model.config.classifier_dropout = dropout
        if isinstance(getattr(model, "dropout", None), torch.nn.Dropout):
            model.dropout.p = dropout
    return model


def load_reward_model(path: str | Path, kind: str, dtype: str = "float32") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a saved reward model; checks the kind first (see
    check_reward_model_dir)."""
    check_reward_model_dir(path, kind)
    tokenizer = load_tokenizer(path)
    try:
        model = _auto_class(kind).from_pretrained(str(path), dtype=resolve_dtype(dtype))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load the {kind} from {str(path)!r}: {err}") from err
    return model, tokenizer


def prm_meta(model: Any) -> dict[str, Any]:
    """The PRM's step format (separator, split rule, num_classes) from its config."""
    meta = dict(getattr(model.config, PRM_META_KEY, None) or {})
    meta.setdefault("separator", "\n")
    meta.setdefault("split", "think")
    meta["num_classes"] = int(model.config.num_labels)
    return meta


def _decoder_hidden(model: Any, input_ids: Tensor, attention_mask: Tensor,
                    packing: bool = False) -> Tensor:
    """Last hidden states [B, T, H] of the reward model's decoder (`packing`: the rows as one
    sequence, `posttrain.models.packing`; 0 at padded positions)."""
    decoder = getattr(model, model.base_model_prefix)
    if packing:
        return packed_outputs(decoder, input_ids, attention_mask, 0, input_ids.shape[1])
    count_positions(attention_mask)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state


def sequence_scores(model: Any, input_ids: Tensor, attention_mask: Tensor,
                    packing: bool = False) -> Tensor:
    """ORM scores [B] fp32 read at the last real token of each row.

    Args:
        input_ids: [B, T] (either padding side). attention_mask: [B, T], 1 on real tokens.
    """
    mask = attention_mask.bool()
    hidden = _decoder_hidden(model, input_ids, mask.long(), packing)  # [B, T, H]
    last = last_positions(mask)  # [B]
    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
    return model.score(pooled).squeeze(-1).float()  # [B]


def last_positions(mask: Tensor) -> Tensor:
    """Index [B] of each row's last True position in ``mask`` [B, T] (0 for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [B, T]
    return torch.where(mask, positions, -1).amax(-1).clamp(min=0)  # [B]


def position_scores(model: Any, input_ids: Tensor, attention_mask: Tensor,
                    packing: bool = False) -> Tensor:
    """ORM score head at EVERY position, [B, T] fp32 (the token-level objective's input).

    Position ``last_positions(attention_mask)`` of each row equals :func:`sequence_scores`.
    """
    hidden = _decoder_hidden(model, input_ids, attention_mask.long(), packing)  # [B, T, H]
    return model.score(hidden).squeeze(-1).float()  # [B, T]


def token_logits(model: Any, input_ids: Tensor, attention_mask: Tensor,
                 packing: bool = False) -> Tensor:
    """PRM class logits at every position, [B, T, C] fp32 (right padding; `packing`: as
    `_decoder_hidden`)."""
    if packing:
        return packed_outputs(model, input_ids, attention_mask, 0, input_ids.shape[1]).float()
    count_positions(attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask.long(),
                 use_cache=False).logits.float()


def encode_steps(tokenizer: Any, prompt_text: str, steps: list[str],
                 separator: str) -> tuple[list[int], list[int]]:
    """Token ids of ``prompt_text + s1 + sep + s2 + sep + ...`` and each step's end position.

    Each ``step + separator`` is tokenized on its own, so the position of its last token (the
    separator's) is exact whatever the tokenizer. ``prompt_text`` is already rendered.
    """
    ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    chunks = (tokenizer([s + separator for s in steps], add_special_tokens=False)["input_ids"]
              if steps else [])
    ends = []
    for chunk in chunks:
        ids += chunk
        ends.append(len(ids) - 1)
    return ids, ends


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded ids [B, T] and bool mask [B, T]."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = True
    return ids, mask
