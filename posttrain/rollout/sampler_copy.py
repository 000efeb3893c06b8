"""A bf16 copy of the policy for the sampler, used when training runs under bf16 autocast.

Under autocast the decode loop keeps the residual stream, the rotary-embedded keys and hence the
KV cache in fp32, and every layer re-casts its activations and the whole cached keys and values
to bf16 at every generated token (``aten::copy_`` was a quarter of a decode step on the CPU, 19M
Llama). The copy's transformer body holds bf16 weights and runs without autocast, so activations
and the cache stay bf16 and nothing is re-cast. The LM head is *not* copied: the copy's
output-embedding module calls the policy's own head (fp32 master weights) on the hidden state
cast to fp32, so sampling probabilities and the rollout log-probs come from an fp32 head as
under autocast. The learner is unchanged (fp32 master weights, fp32 log-probs).

`BF16Sampler.sync` copies the policy's current weights into the copy; the trainer calls it
before every generation, so the copy never lags an optimizer step.

On a CPU with oneDNN bf16 support the body's linear layers run on weights pre-packed into
oneDNN's blocked layout (`torch.ops.mkldnn._linear_pointwise`, re-packed at every `sync`): an
``nn.Linear`` call re-packs its weight on every call, which at decode's few rows is half the
cost of the matrix multiply (19M Llama, 64 rows: 80 -> about 40 us per 512 x 512 layer). The
outputs are bit-identical to ``nn.Linear`` (checked once per process, else not used).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from posttrain.rollout.logits import embeddings, patched_forward

__all__ = ["BF16Sampler", "bf16_clone", "bf16_sampler_supported", "fp32_input"]


def bf16_sampler_supported(model: torch.nn.Module) -> bool:
    """A plain (non-PEFT, non-sharded) model with an ``nn.Linear`` output embedding."""
    if hasattr(model, "get_base_model") or hasattr(model, "peft_config"):
        return False
    if any(type(p) is not torch.nn.Parameter for p in model.parameters()):  # DTensor (FSDP2)
        return False
    return isinstance(embeddings(model)[1], torch.nn.Linear)


def bf16_clone(source: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `source` with every floating-point parameter cast to bf16 and frozen
    (buffers such as rotary ``inv_freq`` keep their dtype)."""
    clone = copy.deepcopy(source)
    # an instance-level forward (a wrapper someone put on `source`) would call the source
    clone.__dict__.pop("forward", None)
    clone.requires_grad_(False)
    for p in clone.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    return clone


def fp32_input(head: Any, weight: torch.Tensor) -> Any:
    """A forward that calls `head` (an LM head's forward) on the hidden state cast to the
    dtype of its `weight` (fp32)."""
    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return head(hidden.to(weight.dtype), *args, **kwargs)
    return forward


class BF16Sampler:
    """Holds ``model``: the policy's body in bf16 with the policy's fp32 head.

    Only parameters are cast (buffers such as rotary ``inv_freq`` keep their dtype).
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        if not bf16_sampler_supported(policy):
            raise ValueError("BF16Sampler needs a plain model with an nn.Linear LM head "
                             "(not PEFT, not FSDP-sharded)")
        self.policy = policy
        self.model = bf16_clone(policy)
        self._pairs = list(zip(self.model.parameters(), policy.parameters(), strict=True))
        head = policy.get_output_embeddings()
        # kept for the copy's lifetime: its head module now runs the policy's head
        self._head_ctx = patched_forward(self.model.get_output_embeddings(),
                                         lambda _inner: fp32_input(head, head.weight))
        self._head_ctx.__enter__()
        self._packed: dict[torch.nn.Linear, torch.Tensor] = {}  # body linear -> packed weight
        self._linears: list[torch.nn.Linear] = []
        on_cpu = next(policy.parameters()).device.type == "cpu"
        if on_cpu and packed_linear_supported():
            head_copy = self.model.get_output_embeddings()
            self._linears = [m for m in self.model.modules()
                             if type(m) is torch.nn.Linear and m is not head_copy]
            for module in self._linears:
                module.forward = _packed_forward(module, self._packed)
            self._pack()

    def _pack(self) -> None:
        """(Re-)pack every body linear's current bf16 weight into oneDNN's layout."""
        for module in self._linears:
            self._packed[module] = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), _PACK_ROWS)

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the policy's current parameters into the copy (cast to bf16)."""
        for mine, theirs in self._pairs:
            mine.copy_(theirs)
        self._pack()


_PACK_ROWS = 64  # oneDNN's batch-size hint for the packed layout (any row count works)


@functools.cache
def packed_linear_supported() -> bool:
    """Whether oneDNN's packed bf16 linear exists here and equals ``F.linear`` bit for bit."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g).to(torch.bfloat16)
        b = torch.randn(24, generator=g).to(torch.bfloat16)
        x = torch.randn(3, 5, 16, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        return bool(torch.equal(out, torch.nn.functional.linear(x, w, b)))
    except (RuntimeError, AttributeError):
        return False


def _packed_forward(module: torch.nn.Linear, packed: dict[torch.nn.Linear, torch.Tensor]) -> Any:
    """``module``'s forward on its pre-packed weight (falls back to F.linear for other dtypes)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = packed.get(module)
        if weight is None or x.dtype != torch.bfloat16 or torch.is_grad_enabled():
            return torch.nn.functional.linear(x, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, module.bias, "none", [], "")
    return forward
