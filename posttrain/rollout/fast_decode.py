"""A lean decode step for the bf16 sampler copy of standard Llama-family models.

One generated token for every running row of a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
``MistralForCausalLM`` (full attention only), written with as few tensor operations as the
computation needs. The transformers forward spends most of a small model's decode step outside
its matrix multiplies (19M Llama, 64 rows: ~22 ms a call, of which ~8 ms are matmuls): mask
creation, rotary embeddings per layer, output dataclasses and many small ops. Here:

- the query/key/value and the gate/up projections are each one fused linear, with the
  preceding RMSNorm weight folded into their input columns; on a CPU with oneDNN bf16 support
  every weight is pre-packed for ``torch.ops.mkldnn._linear_pointwise`` (as `BF16Sampler`
  does) and the residual adds after o_proj / down_proj are fused into those calls. The weights
  are rebuilt at every `LeanDecoder.pack` (the sampler's ``sync``);
- cos/sin are computed once per step for all layers, by the model's own ``rotary_emb`` (so any
  rope type it supports), and applied to queries and keys together;
- keys/values are written in place into the `PreallocatedLayer` buffers ``[n, H_kv, capacity,
  D]`` the prefill filled (row compaction and group repeat act on those buffers);
- attention is one ``scaled_dot_product_attention`` call per layer with an additive padding mask,
  grouped-query attention by viewing the queries as ``[n, H_kv, H / H_kv, D]`` (no K/V repeat);
- RMSNorm is ``F.rms_norm`` without weight (fp32 normalisation then a bf16 cast, bit-equal to
  transformers' ``LlamaRMSNorm`` before its weight product, which is folded as said above);
- the logits come from the model's output embedding (the sampler copy's is the policy's fp32
  head).

The prefill stays on the transformers forward. Any other model class or config (sliding window,
non-SiLU MLP, attention dropout, ...) is not registered and runs today's path.

Notation: n running rows, E hidden size, H query heads, H_kv key/value heads, D head dimension,
L cached positions (after this step's write), V vocabulary.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.rollout.kv_cache import PreallocatedLayer

__all__ = ["LeanDecoder", "lean_decoder", "lean_decode_unsupported", "register_lean_decoder"]

_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_DECODERS: weakref.WeakKeyDictionary[torch.nn.Module, LeanDecoder] = weakref.WeakKeyDictionary()


def lean_decode_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot use the lean step (None when it can): the exact class must be one of
    Llama / Qwen2 / Mistral ForCausalLM with SiLU MLPs, full attention in every layer, no
    attention dropout, bf16 body weights and the standard module layout."""
    name = type(model).__name__
    module = type(model).__module__
    if name not in _CLASSES or not module.startswith("transformers.models."):
        return f"model class {module}.{name} is not one of {_CLASSES}"
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act={getattr(cfg, 'hidden_act', None)!r} (needs 'silu')"
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) != 0.0:
        return "attention_dropout > 0"
    if getattr(cfg, "sliding_window", None) is not None:
        return f"sliding_window={cfg.sliding_window} (needs full attention)"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return f"layer_types={cfg.layer_types} (needs full attention in every layer)"
    if getattr(cfg, "_attn_implementation", None) not in (None, "sdpa", "eager"):
        return f"attention implementation {cfg._attn_implementation!r}"
    body = model.model
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(m) is not torch.nn.Linear or m.weight.dtype != torch.bfloat16
               for m in linears):
            return "a projection is not a bf16 nn.Linear"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "attention has q/k norms"
    return None


def register_lean_decoder(model: torch.nn.Module) -> LeanDecoder | None:
    """Build and register the lean step for `model` (a bf16 sampler copy) if it is supported;
    `lean_decoder` then finds it. Call `LeanDecoder.pack` after every weight change."""
    if lean_decode_unsupported(model) is not None:
        return None
    decoder = LeanDecoder(model)
    _DECODERS[model] = decoder
    return decoder


def lean_decoder(model: torch.nn.Module, cache: Any) -> LeanDecoder | None:
    """The registered lean step of `model` when it can run on `cache` now: every cache layer is
    an initialised `PreallocatedLayer` and bf16 autocast is off. Else None (today's path)."""
    decoder = _DECODERS.get(model)
    if decoder is None or not decoder.enabled or torch.is_autocast_enabled(decoder.device.type):
        return None
    layers = getattr(cache, "layers", [])
    ok = len(layers) == decoder.n_layers and all(
        type(la) is PreallocatedLayer and la.is_initialized for la in layers)
    return decoder if ok else None


@dataclass
class _Linear:
    """A (possibly fused) bf16 linear on oneDNN's pre-packed weight, or on the plain one."""

    weight: Tensor  # [out, in] plain, or oneDNN's packed layout
    bias: Tensor | None  # [out]
    packed: bool

    def __call__(self, x: Tensor) -> Tensor:
        """x: [n, in] -> [n, out]."""
        if self.packed:
            return _LINEAR(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add(self, x: Tensor, residual: Tensor) -> Tensor:
        """``residual + self(x)`` in one call (one rounding) where it can be fused."""
        if self.packed:
            return _LINEAR_ADD(x, residual, self.weight, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return residual + F.linear(x, self.weight, self.bias)


try:
    _LINEAR = torch.ops.mkldnn._linear_pointwise
    _LINEAR_ADD = _LINEAR.binary
except (AttributeError, RuntimeError):  # a build without oneDNN: nothing is packed then
    _LINEAR = _LINEAR_ADD = None


def _fused(mods: list[torch.nn.Linear], pack: bool, norm: Tensor | None = None) -> _Linear:
    """The linears stacked along the output dimension (one matmul for all), the preceding
    RMSNorm's `norm` weight [in] folded into the input columns when given (a bf16 product,
    rounded as transformers rounds ``weight * x``), packed for oneDNN when `pack`."""
    weight = torch.cat([m.weight for m in mods]) if len(mods) > 1 else mods[0].weight
    if norm is not None:
        weight = weight * norm
    bias = None
    if any(m.bias is not None for m in mods):
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                          for m in mods])
    if pack:
        from posttrain.rollout.sampler_copy import _PACK_ROWS

        weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
    return _Linear(weight.detach(), None if bias is None else bias.detach(), pack)


@dataclass
class _Layer:
    qkv: _Linear  # [(H + 2 H_kv) D, E], input_layernorm's weight folded in
    o: _Linear  # [E, H D]
    gate_up: _Linear  # [2 I, E], post_attention_layernorm's weight folded in
    down: _Linear  # [E, I]


class LeanDecoder:
    """The lean decode step of one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        self.model = model
        self.body = model.model
        self.n_layers = len(self.body.layers)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.eps = float(cfg.rms_norm_eps)
        self.device = next(model.parameters()).device
        self.layers: list[_Layer] = []
        self.enabled = True  # False: `lean_decoder` returns None (the transformers forward)
        self.pack()

    @torch.no_grad()
    def pack(self) -> None:
        """(Re-)build the fused (and packed) weights from the model's current ones."""
        from posttrain.rollout.sampler_copy import packed_linear_supported

        pack = self.device.type == "cpu" and packed_linear_supported()
        self.layers = []
        for layer in self.body.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                qkv=_fused([a.q_proj, a.k_proj, a.v_proj], pack, layer.input_layernorm.weight),
                o=_fused([a.o_proj], pack),
                gate_up=_fused([m.gate_proj, m.up_proj], pack,
                               layer.post_attention_layernorm.weight),
                down=_fused([m.down_proj], pack)))

    @torch.no_grad()
    def step(self, tok: Tensor, attn: Tensor, pos: Tensor, cache: Any) -> Tensor:
        """Logits [n, V] (the head's dtype) of the next token after `tok` [n].

        attn: [n, L] padding mask (1 = attend) including this token; pos: [n, 1] its position.
        Writes this token's keys/values into `cache` (its `PreallocatedLayer` buffers).
        """
        n, H, Hkv, D = tok.shape[0], self.heads, self.kv_heads, self.head_dim
        h = self.body.embed_tokens(tok)  # [n, E] bf16
        E, half = h.shape[-1], D // 2
        cos, sin = self.body.rotary_emb(h, pos)  # [n, 1, D]: one position per row
        sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)  # rotate_half's sign folded in
        mask = None  # no left padding in any running row: attend to every cached position
        if not bool(attn.all()):
            mask = torch.zeros(attn.shape, dtype=h.dtype, device=h.device)
            mask = mask.masked_fill_(attn == 0, float("-inf"))[:, None, None, :]  # [n, 1, 1, L]
        at = cache.layers[0].length
        if at + 1 > cache.layers[0].capacity:
            raise RuntimeError(f"lean decode: {at + 1} positions exceed the KV cache capacity "
                               f"{cache.layers[0].capacity}")
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            # the RMSNorm weights are folded into the qkv and gate_up weights (`pack`)
            qkv = layer.qkv(F.rms_norm(h, (E,), None, self.eps)).view(n, H + 2 * Hkv, D)
            qk = qkv.narrow(1, 0, H + Hkv)  # [n, H + H_kv, D] queries and keys
            qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # rotary embedding
            kv._k.select(2, at).copy_(qk.narrow(1, H, Hkv))
            kv._v.select(2, at).copy_(qkv.narrow(1, H + Hkv, Hkv))
            kv.length = at + 1
            kv._refresh()  # keys/values: the filled views, as after `PreallocatedLayer.update`
            q = qk.narrow(1, 0, H).unflatten(1, (Hkv, H // Hkv))  # [n, H_kv, H / H_kv, D]
            o = F.scaled_dot_product_attention(q, kv.keys, kv.values, attn_mask=mask,
                                               scale=D ** -0.5)  # [n, H_kv, H / H_kv, D]
            h = layer.o.add(o.reshape(n, H * D), h)
            gate, up = layer.gate_up(F.rms_norm(h, (E,), None, self.eps)).chunk(2, -1)
            h = layer.down.add(F.silu(gate).mul_(up), h)  # [n, E]
        h = self.body.norm(h)
        return self.model.get_output_embeddings()(h)  # [n, V]
