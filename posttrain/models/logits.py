"""The one way logits are computed, shared by the sampler and the learner.

Both call the model's own forward (with ``logits_to_keep``) inside `logits_context`, so whatever a
model family does to its logits after the LM head (Gemma-2 ``final_logit_softcapping``, Granite
``logits_scaling``, Cohere ``logit_scale``, ...) happens identically when sampling and when
training. Under bf16 autocast the transformer body runs in bf16, while the output-embedding module
(the LM head) runs outside autocast on input cast to its own weight dtype: with fp32 weights the
logits, log-probs, ratios and KL stay fp32-accurate. No model family is special-cased: the head is
found with ``get_output_embeddings()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttrain.core.device import autocast_ctx


def embeddings(model: torch.nn.Module) -> tuple[Any, Any]:
    """(input embedding, output embedding / LM head) of a model, None where it has no such
    accessor (``get_input_embeddings`` / ``get_output_embeddings``) or it returns None."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    return (get_in() if callable(get_in) else None), (get_out() if callable(get_out) else None)


def _head_dtype(head: torch.nn.Module) -> torch.dtype | None:
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.dtype
    return next((p.dtype for p in head.parameters()), None)


@contextlib.contextmanager
def head_outside_autocast(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's output-embedding module outside autocast, on input in its weight dtype.

    Patches the head module's ``forward`` for the duration of the context (restored on exit,
    nesting is safe). Without autocast this changes nothing: the head already runs in its weight
    dtype. Models without ``get_output_embeddings()`` run unchanged.
    """
    head = embeddings(model)[1]
    if head is None:
        yield
        return
    dtype = _head_dtype(head)

    def outside_autocast(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=hidden.device.type, enabled=False):
                return inner(hidden if dtype is None else hidden.to(dtype), *args, **kwargs)

        return forward

    with patched_forward(head, outside_autocast):
        yield


@contextlib.contextmanager
def patched_forward(module: torch.nn.Module,
                    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``module.forward`` by ``wrap(original forward)`` for the duration of the context;
    restored on exit (nesting is safe)."""
    had_own = "forward" in module.__dict__
    inner = module.forward
    module.forward = wrap(inner)
    try:
        yield
    finally:
        if had_own:
            module.forward = inner
        else:
            del module.forward


@contextlib.contextmanager
def logits_context(
    model: torch.nn.Module, autocast: bool, device: torch.device | str
) -> Iterator[None]:
    """The context every logits-producing forward runs in: bf16 autocast on `device` when
    `autocast` is set, with the LM head kept in its weight dtype (`head_outside_autocast`)."""
    with autocast_ctx(autocast, device), head_outside_autocast(model):
        yield
