"""Forward passes that turn (prompt, completion) token batches into per-token log-probs.

Shared by every trainer. Logits come from the model's own forward inside
`posttrain.models.logits.logits_context`, as in the sampler, so family-specific logit transforms
apply to both. Cheap by three cuts: all-padding columns are dropped, ``logits_to_keep`` runs the
head only where completion tokens are predicted, and for `FUSED_HEAD_FAMILIES` the head and
log-softmax are fused and chunked (`posttrain.ops.fused_head`: no ``[n, T, V]`` logits). Under
bf16 autocast the LM head and the log-softmax stay in the head's weight dtype (fp32).
More: docs/performance.md, "Module notes", posttrain.engine.forward.

Notation: n sequences in a micro-batch, P prompt tokens (left padded), T completion tokens (right
padded), V vocabulary, H hidden size.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from posttrain.config import BaseConfig
from posttrain.core.padding import count_positions
from posttrain.engine.shared_prefix import shared_prefix_outputs, shared_prefix_supported
from posttrain.models.bf16_copy import sdpa_switchable
from posttrain.models.logits import autocast_ctx, embeddings, logits_context, patched_forward
from posttrain.models.packing import packed_outputs
from posttrain.ops import entropy_from_logits, head_logprobs, token_logprobs
from posttrain.ops.fused_head import DEFAULT_BLOCK_ELEMENTS
from posttrain.ops.masked import trim_padding

# model types whose causal-LM forward is exactly ``lm_head(last_hidden_state)`` (no logit
# scaling or other transform after the head), checked against transformers' modeling code; the
# Gemmas apply ``final_logit_softcapping`` after it when set (Gemma 2's 30.0; Gemma 3's is None)
FUSED_HEAD_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                                 "phi3", "olmo2", "gemma", "gemma2", "gemma3_text", "gpt_oss",
                                 "deepseek_v3"})
# the fused head recomputes the logits in its backward pass (3 head matmuls instead of 2): by
# default it is used only where the full fp32 logits would exceed 64 MB (2 blocks)
FUSE_MIN_ELEMENTS = 2 * DEFAULT_BLOCK_ELEMENTS



def fused_head_supported(model: torch.nn.Module) -> bool:
    """Whether `completion_logprobs` may fuse the LM head (`unfused_reason` is None)."""
    return unfused_reason(model) is None


def unfused_reason(model: torch.nn.Module) -> str | None:
    """Why the LM head cannot be fused, or None: it must be a plain ``nn.Linear`` (not e.g. a
    LoRA-wrapped head) with a plain weight, of a listed family, with no softcapping after it.
    Under FSDP2 the head's weight is a sharded DTensor outside the model's forward, so the head
    runs inside the forward as usual (full logits of a micro-batch; docs/distributed.md)."""
    head = embeddings(model)[1]
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if type(head) is not torch.nn.Linear:
        return f"its LM head is a {type(head).__name__}, not a plain nn.Linear"
    if model_type not in FUSED_HEAD_FAMILIES:
        return f"model type {model_type!r} is not on the fused-head list"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return (f"{model_type} applies final_logit_softcapping="
                f"{config.final_logit_softcapping} after the head")
    if isinstance(head.weight, DTensor):
        return "FSDP2 shards the head's weight"
    return None


_said_full: set[str] = set()


def say_full_logits(model: torch.nn.Module, n: int, T: int) -> None:
    """One stderr line (per reason, rank 0) where a model with an LM head will build [n, T, V]
    logits in full past `FUSE_MIN_ELEMENTS`: their size and why. Called at a run's start with
    its largest micro-batch (`Trainer`), and at the first such forward (a Python API caller)."""
    reason = unfused_reason(model)
    V = int(getattr(model.config, "vocab_size", 0) or 0)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if (reason is None or reason in _said_full or not rank0 or embeddings(model)[1] is None
            or n * T * V <= FUSE_MIN_ELEMENTS):
        return
    _said_full.add(reason)
    size = n * T * V * 4
    text = f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.0f} MB"
    print(f"posttrain: full logits: {n} x {T} x {V} fp32 = {text} per "
          f"micro-batch ({reason}, so the fused chunked head is off; a smaller "
          "micro_batch_size or shorter completions bound them)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _head_as_identity(head: torch.nn.Module) -> Iterator[None]:
    """Make the head module return its input: the model's forward then yields hidden states."""
    with patched_forward(head, lambda inner: lambda hidden, *a, **k: hidden):
        yield


def _completion_outputs(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                        completion_ids: Tensor, response_mask: Tensor,
                        share_prefix: bool, packing: bool = False) -> tuple[Tensor, Tensor]:
    """The model's outputs [n, T', X] at the positions predicting each completion token (X = V
    logits, or H when the head is the identity) and the trimmed completion ids [n, T'].

    With `share_prefix` (and a model that `shared_prefix_supported`), each distinct prompt runs
    once and its completions run on its KV cache (`posttrain.engine.shared_prefix`). With
    `packing`, the rows run as one sequence (`posttrain.models.packing`; 0 at padded columns).
    """
    p_ids, p_mask, c_ids, c_mask = trim_padding(prompt_ids, prompt_mask, completion_ids,
                                                response_mask)
    if packing:
        out = packed_outputs(model, torch.cat([p_ids, c_ids], dim=1),
                             torch.cat([p_mask, c_mask], dim=1), p_ids.shape[1] - 1,
                             c_ids.shape[1])  # [n, T', X]
        return out, c_ids
    if share_prefix and shared_prefix_supported(model):
        out = shared_prefix_outputs(model, p_ids, p_mask, c_ids, c_mask)
        if out is not None:
            return out, c_ids
    ids = torch.cat([p_ids, c_ids], dim=1)  # [n, P'+T']
    attn = torch.cat([p_mask, c_mask], dim=1).long()  # [n, P'+T']
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P'+T']
    count_positions(attn)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False,
                logits_to_keep=c_ids.shape[1] + 1).logits  # [n, T'+1, X]
    return out[:, :-1], c_ids


@contextlib.contextmanager
def learner_attention(model: torch.nn.Module, autocast: bool,
                      device: torch.device | str) -> Iterator[None]:
    """Eager attention for the learner's and the reference's forward passes on the CPU under
    bf16 autocast (the model's own ``sdpa`` otherwise, and outside this context unless the model
    checkpoints its activations: then it stays eager for the backward's recomputation).

    PyTorch's CPU flash-attention backward in bf16 was 14-16% of a 19M GRPO step (95-195 ms
    per layer for 64 x 49 tokens); transformers' eager attention (matmul, fp32 softmax, matmul)
    differentiates several times faster at these lengths (docs/performance.md). No-grad passes
    (the reference, old log-probs) take the same path so that before an update they equal the
    learner's exactly: with sdpa for them the KL at step 1 was 1.4e-5, not 0, on an AVX2 CPU.
    """
    switch = autocast and torch.device(device).type == "cpu" and sdpa_switchable(model)
    if not switch:
        yield
        return
    model.set_attn_implementation("eager")
    if getattr(model, "is_gradient_checkpointing", False):
        # the backward recomputes the layers after this context: switching back to sdpa would
        # make the recomputation differ from the forward (CheckpointError), so it stays eager
        yield
        return
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


def _tied_embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """The input embedding when it is a plain ``nn.Embedding`` sharing its trainable weight
    with the LM head (and no max_norm / scale_grad_by_freq), else None."""
    emb, head = embeddings(model)
    if type(emb) is not torch.nn.Embedding or head is None:
        return None
    weight = emb.weight
    ok = (getattr(head, "weight", None) is weight and weight.requires_grad
          and type(weight) is torch.nn.Parameter and emb.max_norm is None
          and not emb.scale_grad_by_freq and not emb.sparse)
    return emb if ok else None


@contextlib.contextmanager
def tied_lookup_grad_in_place(model: torch.nn.Module) -> Iterator[None]:
    """While differentiating a model whose input embedding is tied to the LM head, add the
    lookup's gradient to the shared weight's ``.grad`` in place (``index_add_`` of its rows).

    Autograd would otherwise sum the head's dense ``[V, H]`` gradient and the lookup's gradient
    for the shared weight out of place before accumulating them: one more ``[V, H]`` fp32
    tensor at the peak of every backward (520 MB at 151,936 x 896; torch.profiler shows the
    ``aten::add``). The lookup reads the weight detached and the gradient reaching its output
    ``[n, L, H]`` is scattered into ``.grad`` by a hook: same values (up to summation order),
    accumulated across micro-batches like any gradient. ``.grad`` is complete once
    ``backward()`` returns (hooks that fire on the weight's own accumulation see the head's
    part only; posttrain syncs gradients after backward).
    """
    emb = _tied_embedding(model) if torch.is_grad_enabled() else None
    if emb is None:
        yield
        return
    weight = emb.weight

    def wrap(_inner: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def forward(ids: Tensor) -> Tensor:
            out = torch.nn.functional.embedding(ids, weight.detach(), emb.padding_idx)
            out.requires_grad_(True)  # [n, L, H]: a leaf whose gradient goes to weight.grad

            def scatter(grad: Tensor) -> None:
                rows, g = ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
                if emb.padding_idx is not None:
                    keep = rows != emb.padding_idx
                    rows, g = rows[keep], g[keep]
                with torch.no_grad():
                    if weight.grad is None:
                        weight.grad = torch.zeros_like(weight)
                    weight.grad.index_add_(0, rows, g)

            out.register_hook(scatter)
            return out

        return forward

    with patched_forward(emb, wrap):
        yield


def _fused_logprobs(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                    completion_ids: Tensor, response_mask: Tensor, temperature: float,
                    autocast: bool, with_entropy: bool, share_prefix: bool = False,
                    entropy_grad: bool = False, packing: bool = False
                    ) -> tuple[Tensor, Tensor | None]:
    """[n, T'] log-probs (and entropies) through the fused chunked head (no [n, T', V])."""
    head = model.get_output_embeddings()
    with autocast_ctx(autocast, prompt_ids.device), _head_as_identity(head):  # bf16 body
        hidden, c_ids = _completion_outputs(model, prompt_ids, prompt_mask, completion_ids,
                                            response_mask, share_prefix, packing)  # [n, T', H]
    return head_logprobs(hidden, head.weight, c_ids, bias=head.bias,
                         temperature=temperature, with_entropy=with_entropy,
                         grad_in_place=True,  # grad_W added into head.weight.grad
                         entropy_grad=entropy_grad)


def completion_logits(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    response_mask: Tensor,
    autocast: bool = False,
    share_prefix: bool = False,
    packing: bool = False,
) -> Tensor:
    """Logits at the positions that predict each completion token.

    Args:
        prompt_ids, prompt_mask: [n, P] left padded; completion_ids, response_mask: [n, T].
        share_prefix: run each distinct prompt once; packing: the rows as one sequence (see
            `_completion_outputs`).
    Returns:
        logits [n, T', V] with T' <= T (trailing all-padding columns removed); logits[:, t]
        predicts completion_ids[:, t].
    """
    with logits_context(model, autocast, prompt_ids.device):
        logits, _ = _completion_outputs(model, prompt_ids, prompt_mask, completion_ids,
                                        response_mask, share_prefix, packing)  # [n, T', V]
    return logits.float()  # no copy when the head is fp32


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    autocast: bool = False,
    with_entropy: bool = False,
    fused: bool | None = None,
    share_prefix: bool = False,
    entropy_grad: bool = False,
    packing: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and optionally entropies) of the completion tokens: the one policy
    forward of every trainer (SFT's NLL, DPO's sequence log-probs, GRPO's and PPO's ratios,
    the references and old log-probs), so they agree bit for bit before an update.

    `fused`: None (default) fuses the LM head and the log-softmax where `fused_head_supported`
    and the fp32 logits would hold more than `FUSE_MIN_ELEMENTS` (no [n, T, V] logits, same
    values up to float summation order); False always goes through `completion_logits`; True
    fuses whenever supported (an error otherwise). `share_prefix`: rows with the same prompt
    share one forward pass over it (`posttrain.engine.shared_prefix`; same values up to float
    summation order), where `shared_prefix_supported`. `packing`: the rows run as one
    sequence (`posttrain.models.packing`; same values up to float summation order).

    Returns:
        logprobs [n, T] fp32 (padded back to the input width, 0 past the trimmed columns; the
        values at other positions outside `response_mask` carry no meaning) and entropy [n, T]
        (differentiable with `entropy_grad`, for PPO's entropy bonus; else detached) or None.
    """
    supported = fused_head_supported(model)
    if fused and not supported:
        raise ValueError(f"fused=True: {unfused_reason(model)}; the fused head needs a plain "
                         f"nn.Linear LM head and a model type in {sorted(FUSED_HEAD_FAMILIES)}")
    n_logits = completion_ids.numel() * int(getattr(model.config, "vocab_size", 0) or 0)
    large = n_logits > FUSE_MIN_ELEMENTS
    fn = (_fused_logprobs if supported and (fused or (fused is None and large))
          else _unfused_logprobs)
    if fused is None and large and not supported:
        say_full_logits(model, *completion_ids.shape)
    with learner_attention(model, autocast, prompt_ids.device), tied_lookup_grad_in_place(model):
        logprobs, entropy = fn(model, prompt_ids, prompt_mask, completion_ids, response_mask,
                               temperature, autocast, with_entropy or entropy_grad, share_prefix,
                               entropy_grad, packing)
    T_full, T = completion_ids.shape[1], logprobs.shape[1]
    if T < T_full:
        pad = (0, T_full - T)
        logprobs = torch.nn.functional.pad(logprobs, pad)
        entropy = None if entropy is None else torch.nn.functional.pad(entropy, pad)
    return logprobs, entropy


def _unfused_logprobs(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                      completion_ids: Tensor, response_mask: Tensor, temperature: float,
                      autocast: bool, with_entropy: bool, share_prefix: bool = False,
                      entropy_grad: bool = False, packing: bool = False
                      ) -> tuple[Tensor, Tensor | None]:
    """[n, T'] log-probs (and entropies) from the model's full logits (any family)."""
    logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, response_mask,
                               autocast, share_prefix, packing)  # [n, T', V]
    T = logits.shape[1]
    logprobs = token_logprobs(logits, completion_ids[:, :T], temperature=temperature)  # [n, T']
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            source = logits if entropy_grad else logits.detach()
            entropy = entropy_from_logits(source, temperature=temperature)  # [n, T']
    return logprobs, entropy


@dataclass(frozen=True)
class PolicyForward:
    """The policy forward of a run, its choices made once (`policy_forward` builds it from the
    config): every trainer's log-probs (learner, reference, old log-probs) go through it, so
    they take one path in one precision. `autocast`: bf16 body, fp32 head and log-softmax;
    `share_prefix`: each distinct prompt runs once; `temperature`: the sampling temperature of
    RL trainers (1 for SFT and DPO); `fused`: see `completion_logprobs`; `packing`: each
    call's rows as one sequence (`posttrain.models.packing`)."""

    autocast: bool = False
    share_prefix: bool = False
    temperature: float = 1.0
    fused: bool | None = None
    packing: bool = False

    def logprobs(self, model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                 completion_ids: Tensor, response_mask: Tensor, with_entropy: bool = False,
                 entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        """[n, T] log-probs and entropies (or None): `completion_logprobs` with these choices."""
        return completion_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                   response_mask, self.temperature, self.autocast,
                                   with_entropy, self.fused, self.share_prefix, entropy_grad,
                                   self.packing)

    @torch.no_grad()
    def batched(self, model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                completion_ids: Tensor, response_mask: Tensor, micro_batch_size: int) -> Tensor:
        """No-grad log-probs [N, T] fp32 over a large batch, `micro_batch_size` rows a call."""
        out = []
        for start in range(0, prompt_ids.shape[0], micro_batch_size):
            sl = slice(start, start + micro_batch_size)
            out.append(self.logprobs(model, prompt_ids[sl], prompt_mask[sl], completion_ids[sl],
                                     response_mask[sl])[0])
        return torch.cat(out)


DEFAULT_FORWARD = PolicyForward()  # fp32, no prompt sharing, temperature 1


def policy_forward(cfg: BaseConfig, fsdp: bool = False, shares_prompts: bool = True,
                   temperature: float = 1.0) -> PolicyForward:
    """The run's `PolicyForward`: bf16 autocast under `autocast_bf16` but not `bf16_compute`
    (its learner copy is bf16 already); prompt sharing under `share_prompt_prefix` but not
    with `torch_compile` (the compiled body is traced for the plain forward) nor under FSDP2
    (its data-dependent number of model calls would give ranks different collectives), and
    only for trainers whose rows repeat prompts (`shares_prompts`); log-probs at the
    `temperature` the trainer samples at; `packing` in place of prompt sharing."""
    return PolicyForward(
        autocast=cfg.autocast_bf16 and not cfg.bf16_compute,
        share_prefix=(cfg.share_prompt_prefix and shares_prompts and not cfg.torch_compile
                      and not fsdp and not cfg.packing),
        temperature=temperature, packing=cfg.packing)
