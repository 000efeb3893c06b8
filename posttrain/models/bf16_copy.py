"""bf16 copies of a model: the sampler's (under `autocast_bf16` / `bf16_compute`) and, for
`bf16_compute: true`, the learner's and the reference's.

Every copy holds the transformer body in bf16 around the source's own fp32 LM head (the hidden
state is cast to fp32 before it); only parameters are cast. `sync()` copies the source's weights
in: before every generation (sampler) and after every optimizer step (learner).
- `BF16SamplingCopy`: runs without autocast (activations and KV cache stay bf16); on a oneDNN bf16
  CPU its linear layers use pre-packed weights (bit-identical, checked once per process); on a
  CPU without AMX its KV cache is fp32 with fp32 decode attention (`fp32_decode_attention_pays`).
- `BF16Copy` (learner / reference; Micikevicius et al. 2018, no loss scaling): bf16 gradients
  go into the master's fp32 ``.grad`` by a post-accumulate-grad hook; the reference is built the
  same way (KL exactly 0 before the first update); eager attention on the CPU; ``compile_body``
  compiles each decoder layer (`compile_layers`). Not supported: PEFT/LoRA, FSDP2 parameters.
More: docs/performance.md, "Module notes", posttrain.models.bf16_copy.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from posttrain.models.logits import embeddings, patched_forward

__all__ = ["DECODE_ATTENTION", "BF16Copy", "BF16SamplingCopy", "bf16_copy_supported"]

DECODE_ATTENTION = "posttrain_fp32_kv"
"""The sampler copy's attention implementation on a CPU without AMX: sdpa in the KV cache's
dtype (registered with transformers' ``AttentionInterface`` and, with sdpa's masks,
``AttentionMaskInterface``)."""


def bf16_copy_supported(model: torch.nn.Module) -> bool:
    """A plain (non-PEFT, non-sharded) model with an ``nn.Linear`` output embedding."""
    if hasattr(model, "get_base_model") or hasattr(model, "peft_config"):
        return False
    if any(type(p) is not torch.nn.Parameter for p in model.parameters()):  # DTensor (FSDP2)
        return False
    return isinstance(embeddings(model)[1], torch.nn.Linear)


def sdpa_switchable(model: torch.nn.Module) -> bool:
    """Whether the model runs transformers' ``sdpa`` attention and can switch to ``eager``."""
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) == "sdpa"
            and callable(getattr(model, "set_attn_implementation", None)))


class BF16Copy:
    """``model``: `source`'s body in bf16 around `source`'s own fp32 LM head parameters.

    `trainable`: gradients flow into the source's fp32 ``.grad``. `packed`: oneDNN-packed
    linears for no-grad CPU passes (the sampler). `eager`: eager attention on the CPU.
    """

    def __init__(self, source: torch.nn.Module, trainable: bool = False,
                 compile_body: bool = False, packed: bool = False, eager: bool = True) -> None:
        if not bf16_copy_supported(source):
            raise ValueError("a bf16 copy needs a plain model with an nn.Linear LM head "
                             "(not PEFT/LoRA, not FSDP-sharded)")
        self.model = _bf16_clone(source)
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
            p.requires_grad_(master.requires_grad if trainable else False)
            self._pairs.append((p, master))
            if p.requires_grad and trainable:
                p.register_post_accumulate_grad_hook(_to_master(master))
        # kept for the copy's lifetime: the head runs on the hidden state cast to fp32
        self._head_ctx = patched_forward(head, lambda inner: _fp32_input(inner, head.weight))
        self._head_ctx.__enter__()
        self.on_cpu = on_cpu = next(source.parameters()).device.type == "cpu"
        if eager and on_cpu and sdpa_switchable(self.model):
            self.model.set_attn_implementation("eager")
        self.model.train(source.training)
        if compile_body:
            compile_layers(self.model)
        self._packed: dict[torch.nn.Linear, torch.Tensor] = {}  # body linear -> packed weight
        self._linears: list[torch.nn.Linear] = []
        if packed and on_cpu and packed_linear_supported():
            self._linears = [m for m in self.model.modules()
                             if type(m) is torch.nn.Linear and m is not head]
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
        """Copy the source's current parameters into the copy (cast to bf16)."""
        for mine, master in self._pairs:
            mine.copy_(master)
        self._pack()


class BF16SamplingCopy(BF16Copy):
    """The sampler's copy: frozen, oneDNN-packed linears on the CPU, the model's own
    attention implementation."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__(policy, packed=True, eager=False)
        if self.on_cpu and sdpa_switchable(self.model) and fp32_decode_attention_pays():
            self.fp32_kv_cache(True)

    def fp32_kv_cache(self, on: bool) -> None:
        """Keep the KV cache in fp32 and attend in fp32 (`DECODE_ATTENTION`), or the model's
        bf16 cache and sdpa (off)."""
        if on:
            _register_decode_attention()
            self.model.set_attn_implementation(DECODE_ATTENTION)
            self.model.kv_cache_dtype = torch.float32
        else:
            self.model.set_attn_implementation("sdpa")
            self.model.__dict__.pop("kv_cache_dtype", None)


def kv_dtype_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' ``sdpa`` attention in the dtype of the keys and values it is given (the
    cache's): query [n, H, q, D] cast to it, the output [n, q, H, D] cast back to the query's."""
    out, weights = sdpa_attention_forward(module, query.to(key.dtype), key, value,
                                          attention_mask, **kwargs)
    return out.to(query.dtype), weights


def fp32_decode_attention_pays() -> bool:
    """Whether the sampler copy should keep an fp32 KV cache and attend in fp32 on this CPU:
    one without AMX tiles. Measured per call, 64 rows x 8 heads, 20 / 49
    / 150 cached positions, 2 threads, AVX-512 BF16 EPYC: fp32 0.31 / 0.90 / 3.9 ms, bf16 1.3 /
    3.0 / 7.0 ms. On an AMX Xeon (round 4, benchmarks/performance_history.md) the bf16 kernel
    took 0.45-0.55 ms at 40 positions, 2-4x faster than the alternatives tried there."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return amx is not None and not amx()


@functools.cache
def _register_decode_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, kv_dtype_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


def _bf16_clone(source: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `source` with every floating-point parameter cast to bf16 and frozen."""
    clone = copy.deepcopy(source)
    # an instance-level forward (a wrapper someone put on `source`) would call the source
    clone.__dict__.pop("forward", None)
    clone.requires_grad_(False)
    for p in clone.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    return clone


def _fp32_input(head: Any, weight: torch.Tensor) -> Any:
    """A forward calling `head` on the hidden state cast to its `weight`'s dtype (fp32)."""
    def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return head(hidden.to(weight.dtype), *args, **kwargs)
    return forward


def _to_master(master: torch.nn.Parameter) -> Any:
    def hook(p: torch.Tensor) -> None:
        grad = p.grad.to(master.dtype)  # a new fp32 tensor
        if master.grad is None:
            master.grad = grad
        else:
            master.grad.add_(grad)
        p.grad = None
    return hook


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (the first non-empty ``layers``
    ``ModuleList``, e.g. ``model.model.layers``); [] when there is none."""
    for mod in model.modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return list(layers)
    return []


def compile_layers(model: torch.nn.Module) -> int:
    """`torch.compile` each decoder layer in place (dynamic shapes): the layers of a model share
    one class, so one graph is traced and reused by all of them (per grad mode), instead of
    one graph of the whole unrolled body. Returns the number of layers compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


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
