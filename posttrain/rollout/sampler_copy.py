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
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from posttrain.rollout.logits import embeddings, patched_forward

__all__ = ["BF16Sampler", "bf16_sampler_supported"]


def bf16_sampler_supported(model: torch.nn.Module) -> bool:
    """A plain (non-PEFT, non-sharded) model with an ``nn.Linear`` output embedding."""
    if hasattr(model, "get_base_model") or hasattr(model, "peft_config"):
        return False
    if any(type(p) is not torch.nn.Parameter for p in model.parameters()):  # DTensor (FSDP2)
        return False
    return isinstance(embeddings(model)[1], torch.nn.Linear)


class BF16Sampler:
    """Holds ``model``: the policy's body in bf16 with the policy's fp32 head.

    Only parameters are cast (buffers such as rotary ``inv_freq`` keep their dtype).
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        if not bf16_sampler_supported(policy):
            raise ValueError("BF16Sampler needs a plain model with an nn.Linear LM head "
                             "(not PEFT, not FSDP-sharded)")
        self.policy = policy
        self.model = copy.deepcopy(policy)
        self.model.requires_grad_(False)
        for p in self.model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
        self._pairs = list(zip(self.model.parameters(), policy.parameters(), strict=True))
        head = policy.get_output_embeddings()

        def fp32_head(_inner: Any) -> Any:
            def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                return head(hidden.to(head.weight.dtype), *args, **kwargs)
            return forward

        # kept for the copy's lifetime: its head module now runs the policy's head
        self._head_ctx = patched_forward(self.model.get_output_embeddings(), fp32_head)
        self._head_ctx.__enter__()

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the policy's current parameters into the copy (cast to bf16)."""
        for mine, theirs in self._pairs:
            mine.copy_(theirs)
