"""LoRA adapters through ``peft``, and the frozen reference model as "adapters disabled".

With LoRA the reference policy needs no second copy of the weights: running the same model
inside :func:`adapters_disabled` gives the base (reference) log-probs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def apply_lora(
    model: torch.nn.Module,
    *,
    r: int = 8,
    alpha: int = 16,
    dropout: float = 0.0,
    target_modules: Sequence[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> Any:
    """Wrap ``model`` in a ``peft`` LoRA model; only the adapter weights stay trainable.

    ``target_modules`` is a list of module-name suffixes or ``"all-linear"``.
    """
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise ValueError(f"LoRA rank r must be >= 1, got {r}")
    targets = lora_targets(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def lora_targets(target_modules: Sequence[str] | str) -> list[str] | str:
    """peft's `target_modules`: ``"all-linear"`` (also as a one-item list) stays a string."""
    if isinstance(target_modules, str):
        return target_modules
    targets = list(target_modules)
    return "all-linear" if targets == ["all-linear"] else targets


def check_lora_targets(model: torch.nn.Module, target_modules: Sequence[str] | str) -> None:
    """Raise ValueError naming the targets no module of `model` is called (peft matches a
    list entry against the end of each module's name); works on a ``meta`` model, so it runs
    before the weights load."""
    targets = lora_targets(target_modules)
    if isinstance(targets, str):  # all-linear, or a regular expression: peft's own rule
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"config key 'lora_target_modules': {missing} match no module of this "
                         f"model; its linear layers are {linear} (or use all-linear)")


def has_adapters(model: torch.nn.Module) -> bool:
    """True when ``model`` is a peft model (adapters can be switched off)."""
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block ``model`` computes with its adapters off (the reference policy).

    Raises ValueError for a model without adapters: a full fine-tune needs a separate
    reference model, and silently using the trained policy as its own reference would make
    the KL term zero.
    """
    if not has_adapters(model):
        raise ValueError("adapters_disabled needs a peft (LoRA) model; this model has no "
                         "adapters, so load a separate reference model instead")
    with model.disable_adapter():
        yield model

