"""bf16 compute copies for `bf16_compute: true`: forward and backward on bf16 weights, fp32
master weights, fp32 optimizer state, fp32 LM head and fp32 log-probs.

Mixed precision with a bf16 model copy (Micikevicius et al. 2018, "Mixed Precision Training",
arXiv:1710.03740, with bf16 instead of fp16 and therefore no loss scaling). Under plain bf16
autocast the weights stay fp32 and every op casts them (and the fp32 residual stream) again;
on the CPU the casts and the fp32 element-wise work took as long as the matrix multiplies of a
19M Llama step (docs/performance.md). Here the transformer body holds bf16 weights:

- `BF16Copy(policy, trainable=True)`: the learner. Its body parameters are bf16 copies of the
  policy's; its LM head module *shares* the policy's fp32 head parameters (the hidden state is
  cast to fp32 before it), so log-probs come from the fp32 head, the fused chunked head sees the
  fp32 weight and the head's gradient lands on the master directly. Every other parameter's
  bf16 gradient is added into the master's fp32 ``.grad`` as soon as autograd has accumulated
  it (a post-accumulate-grad hook) and freed, so gradient accumulation over micro-batches
  happens in fp32 and the optimizer, clipping and gradient sync only ever see the master.
  `sync()` copies the master's weights in after every optimizer step.
- `BF16Copy(reference)`: the frozen reference, built the same way, so before the first update
  the reference's log-probs equal the learner's bit for bit (KL exactly 0).

On the CPU both copies use transformers' eager attention: PyTorch's CPU flash-attention backward
is slow in bf16, and the reference must take the same path as the learner for the KL to start
at 0. Not supported: PEFT/LoRA models and FSDP2-sharded parameters (`bf16_sampler_supported`).

With ``compile_body`` (`torch_compile: true`) the transformer body's forward is compiled
(`torch.compile`, dynamic shapes): inductor fuses the element-wise work around the matrix
multiplies (norms, rotary, SiLU, softmax) in the forward and the backward. Inductor compiles a
graph that will be differentiated differently from a no-grad one (its fusions round
differently), so every call, the reference's and no-grad ones included, runs the
differentiable graph and detaches the result: the reference and the learner stay bit-identical
before an update, and no-grad log-probs equal the ones the loss differentiates.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.rollout.logits import patched_forward
from posttrain.rollout.sampler_copy import bf16_clone, bf16_sampler_supported, fp32_input
from posttrain.trainers.forward import sdpa_switchable

__all__ = ["BF16Copy"]


class BF16Copy:
    """``model``: `source`'s body in bf16 around `source`'s own fp32 LM head parameters."""

    def __init__(self, source: torch.nn.Module, trainable: bool = False,
                 compile_body: bool = False) -> None:
        if not bf16_sampler_supported(source):  # same needs as the sampler copy
            raise ValueError("bf16_compute needs a plain model with an nn.Linear LM head "
                             "(not PEFT/LoRA, not FSDP-sharded)")
        self.model = bf16_clone(source)
        src_head, head = source.get_output_embeddings(), self.model.get_output_embeddings()
        head.weight = src_head.weight  # the fp32 master head (unties a tied copy's embedding)
        if src_head.bias is not None:
            head.bias = src_head.bias
        shared = {id(src_head.weight), id(src_head.bias)}
        masters = dict(source.named_parameters(remove_duplicate=False))
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for name, p in self.model.named_parameters():
            if id(p) in shared:
                continue
            master = masters[name]
            # a compiled frozen copy still takes the differentiable graph (see above); its
            # outputs are detached, so no gradient ever reaches it
            p.requires_grad_(master.requires_grad if trainable else compile_body)
            self._pairs.append((p, master))
            if p.requires_grad and trainable:
                p.register_post_accumulate_grad_hook(self._to_master(master))
        # kept for the copy's lifetime: the head runs on the hidden state cast to fp32
        self._head_ctx = patched_forward(head, lambda inner: fp32_input(inner, head.weight))
        self._head_ctx.__enter__()
        if next(source.parameters()).device.type == "cpu" and sdpa_switchable(self.model):
            self.model.set_attn_implementation("eager")
        self.model.train(source.training)
        if compile_body:
            body = self.model.base_model
            body.forward = _always_differentiable(torch.compile(body.forward, dynamic=True))

    @staticmethod
    def _to_master(master: torch.nn.Parameter) -> Any:
        def hook(p: torch.Tensor) -> None:
            grad = p.grad.to(master.dtype)  # a new fp32 tensor
            if master.grad is None:
                master.grad = grad
            else:
                master.grad.add_(grad)
            p.grad = None
        return hook

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the source's current parameters into the copy (cast to bf16)."""
        for mine, master in self._pairs:
            mine.copy_(master)


def _always_differentiable(compiled: Any) -> Any:
    """Run `compiled` with grad enabled; under no_grad return its output detached."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        with torch.enable_grad():
            out = compiled(*args, **kwargs)
        for key, value in out.items():  # a ModelOutput: detach every tensor in it
            if isinstance(value, torch.Tensor):
                out[key] = value.detach()
        return out
    return forward
