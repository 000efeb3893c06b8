"""The sampler protocol: one interface for every sampler (config key `rollout_engine`).

Every caller that samples completions (training, held-out evaluation, search, the offline label
and pair generators of `posttrain.tasks` through `model_sampler`) goes through a
`Sampler`: `generate` returns a group-contiguous `Rollout` whose `logprobs` are the
sampler's log-probs of the sampled tokens under the full distribution at the sampling
temperature; `update_weights(model, weights_version)` hands the sampler the policy's current weights
(nothing happens when `weights_version` has not changed); `sleep` / `wake` free and take back the
sampler's memory around training; `close` releases it for good. A sampler may return its rollout
on any device (vLLM's are built on the CPU): whoever trains on it takes it through `on_device`,
which moves it to the trainer's device or refuses it in one line.
Samplers: `hf` (`HFSampler`, the default and the CPU path) and the vLLM samplers of
`posttrain.rollout.vllm_sampler`. `register_sampler` adds or replaces a factory (e.g. a fake).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from posttrain.models.bf16_copy import BF16SamplingCopy, bf16_copy_supported
from posttrain.rollout.completion import Completion
from posttrain.rollout.episodes import AgentSampler
from posttrain.rollout.hf import (
    Carried,
    SamplingParams,
    generate,
    sample_turn,
    sequence_uniforms,
    stop_token_ids,
)
from posttrain.rollout.record import Rollout, pad_id
from posttrain.rollout.tools import AgentSpec

__all__ = ["SAMPLERS", "SamplerFactory", "HFSampler", "Role", "Sampler", "build_sampler",
           "model_sampler", "on_device", "register_sampler"]

Role = Literal["train", "eval"]
"""What a sampler is built for: `train` samples rollouts from the policy being trained (the
`hf` sampler then uses the bf16 sampler copy under autocast_bf16 / bf16_compute); `eval` runs a
model as it is (held-out evaluation, search, label generation)."""


@runtime_checkable
class Sampler(Protocol):
    """What every sampler offers the trainers, the evaluation and search."""

    name: str
    runs_policy: bool
    """True when `generate` runs the trainer's own module (its weights must be whole: under
    FSDP2 the caller wraps generation in `Trainer.gathered()`); False for a separate copy."""

    def generate(self, prompts: list[str], *, group_size: int = 1,
                 params: SamplingParams | None = None, seeds: list[int] | None = None,
                 stop_ids: list[int] | None = None, rows: list[dict[str, Any]] | None = None,
                 batch_size: int = 0, generator: torch.Generator | None = None) -> Rollout:
        """`group_size` completions per rendered prompt: a group-contiguous `Rollout` of
        N = len(prompts) * group_size sequences. `seeds` (N): one seed per sequence; else
        `generator` draws. `batch_size` > 0: generation batches of that many sequences."""
        ...

    def update_weights(self, model: torch.nn.Module, weights_version: int) -> None:
        """Take `model`'s current weights; nothing when `weights_version` equals the last one
        taken."""
        ...

    def sleep(self) -> None:
        """Free the sampler's memory while the trainer trains (no-op where there is none)."""
        ...

    def wake(self) -> None:
        """Take the memory back (`generate` wakes a sleeping sampler by itself)."""
        ...

    def close(self) -> None:
        """Release everything; the sampler is not used again."""
        ...


class HFSampler:
    """Today's sampler (`posttrain.rollout.hf.generate`) behind the sampler protocol.

    `sampler_copy`: sample from a bf16 copy of the model with its fp32 LM head
    (`posttrain.models.bf16_copy.BF16SamplingCopy`), re-synced whenever the weights' version
    changes and run without autocast; a model that cannot be copied (LoRA, FSDP2) samples
    itself under autocast instead. Otherwise the model samples itself, under bf16 autocast
    when `autocast` is set.
    """

    name = "hf"
    runs_policy = True

    def __init__(self, tokenizer: Any, *, sampler_copy: bool = False,
                 autocast: bool = False) -> None:
        self.tokenizer = tokenizer
        self.sampler_copy = sampler_copy
        self.autocast = autocast
        self.model: torch.nn.Module | None = None
        self.weights_version: int | None = None
        self._copy: BF16SamplingCopy | None = None
        self._copy_of: torch.nn.Module | None = None
        self._carried: Carried | None = None

    def update_weights(self, model: torch.nn.Module, weights_version: int) -> None:
        if model is self.model and weights_version == self.weights_version:
            return
        self.model, self.weights_version = model, weights_version
        if not self.sampler_copy:
            return
        if self._copy_of is not model:
            self._copy_of = model
            self._copy = BF16SamplingCopy(model) if bf16_copy_supported(model) else None
        if self._copy is not None:
            self._copy.sync()

    def sampling_model(self) -> tuple[torch.nn.Module, bool]:
        """(module, autocast) that `generate` samples with."""
        if self.model is None:
            raise RuntimeError("HFSampler: call update_weights(model, weights_version) before "
                               "generate")
        if not self.sampler_copy:
            return self.model, self.autocast
        if self._copy is None:
            return self.model, True
        return self._copy.model, False

    def generate(self, prompts: list[str], *, group_size: int = 1,
                 params: SamplingParams | None = None, seeds: list[int] | None = None,
                 stop_ids: list[int] | None = None, rows: list[dict[str, Any]] | None = None,
                 batch_size: int = 0, generator: torch.Generator | None = None) -> Rollout:
        model, autocast = self.sampling_model()
        return generate(model, self.tokenizer, prompts, group_size=group_size, rows=rows,
                        params=params, autocast=autocast, generator=generator,
                        batch_size=batch_size, seeds=seeds, stop_ids=stop_ids)

    @property
    def stops(self) -> list[int]:
        """The ids that end a completion (`stop_token_ids` of the sampling model)."""
        return stop_token_ids(self.sampling_model()[0], self.tokenizer)

    def sample_ids(self, contexts: list[list[int]], params: SamplingParams, stops: list[int], *,
                   max_tokens: list[int] | None = None, seeds: list[int] | None = None,
                   generator: torch.Generator | None = None, keys: list[int] | None = None
                   ) -> list[Completion]:
        """One completion of each token-id list, as the vLLM samplers' `sample_ids`. `keys`
        (multi-turn episodes): each context's episode; one seen in the last call continues on
        the KV cache carried from it (only the ids appended since are prefilled), the rows of
        the others are freed; `end_turns` frees the cache."""
        model, autocast = self.sampling_model()
        budgets = max_tokens or [params.max_new_tokens] * len(contexts)
        uniforms = (sequence_uniforms(seeds, max(budgets))
                    if seeds is not None and not params.greedy else None)  # [n, T]
        was_training = model.training
        model.eval()
        try:
            toks, mask, lps, trunc, carried = sample_turn(
                model, contexts, keys or list(range(len(contexts))), budgets, params, stops,
                pad_id(self.tokenizer, stops), autocast, generator, uniforms,
                self._carried if keys is not None else None)
        finally:
            model.train(was_training)
        self._carried = carried if keys is not None else None
        toks, lps, trunc = toks.tolist(), lps.tolist(), trunc.tolist()
        return [Completion(toks[i][:n], lps[i][:n], "length" if trunc[i] else "stop")
                for i, n in enumerate(mask.sum(1).tolist())]  # length: no stop id in budget

    def end_turns(self) -> None:
        """Free the KV cache carried between the turns of multi-turn episodes."""
        self._carried = None

    def sleep(self) -> None:
        """Nothing to free: the sampler is the policy (or a copy that stays)."""

    def wake(self) -> None:
        """Nothing to take back."""

    def close(self) -> None:
        self.model, self.weights_version, self._copy, self._copy_of = None, None, None, None
        self._carried = None


def model_sampler(model: torch.nn.Module, tokenizer: Any, autocast: bool = False) -> HFSampler:
    """The `hf` sampler on a model object as it is (offline label and pair generation, PRM beam
    search's step sampling), under bf16 autocast when `autocast`."""
    sampler = HFSampler(tokenizer, autocast=autocast)
    sampler.update_weights(model, 0)
    return sampler


def on_device(rollout: Rollout, device: torch.device, sampler: str) -> Rollout:
    """`rollout` with every tensor on `device` (the trainer's), moved where it is elsewhere;
    refused in one line when a tensor holds no data (``meta``) and so cannot be moved."""
    where = rollout.devices()
    if any(d.type == "meta" for d in where):
        raise ValueError(f"config key 'rollout_engine'={sampler}: the sampler returned its rollout "
                         f"on {sorted(map(str, where))}, tensors without data; the trainer "
                         f"needs them on {device}")
    return rollout if where <= {device} else rollout.to(device)


SamplerFactory = Callable[..., Sampler]
"""`factory(cfg, tokenizer, *, role, dist, model)` -> a sampler: `cfg` a config with the
`rollout_engine` keys, `role` "train" or "eval", `dist` the trainer's `Dist` (None outside a
trainer), `model` the policy (an in-process sampler starts with it; may be None)."""


def _hf(cfg: Any, tokenizer: Any, *, role: Role = "eval", dist: Any = None,
        model: torch.nn.Module | None = None) -> HFSampler:
    copy = role == "train" and (cfg.autocast_bf16 or cfg.bf16_compute)
    sampler = HFSampler(tokenizer, sampler_copy=copy, autocast=cfg.autocast_bf16)
    if model is not None:
        sampler.update_weights(model, 0)
    return sampler


def _vllm_colocate(cfg: Any, tokenizer: Any, **kw: Any) -> Sampler:
    from posttrain.rollout.vllm_sampler import VLLMColocateSampler

    return VLLMColocateSampler.from_config(cfg, tokenizer, **kw)


def _vllm_server(cfg: Any, tokenizer: Any, **kw: Any) -> Sampler:
    from posttrain.rollout.vllm_server import VLLMServerSampler

    return VLLMServerSampler.from_config(cfg, tokenizer, **kw)


SAMPLERS: dict[str, SamplerFactory] = {"hf": _hf, "vllm_colocate": _vllm_colocate,
                                     "vllm_server": _vllm_server}
"""`rollout_engine` value -> factory."""


def register_sampler(name: str, factory: SamplerFactory) -> SamplerFactory | None:
    """Add or replace the factory of `rollout_engine: name`; returns the one it replaced (to
    restore it), or None. The config accepts only the names it documents, so a test double is
    registered under one of them, e.g. "hf" wrapping the real `hf` factory."""
    previous = SAMPLERS.get(name)
    SAMPLERS[name] = factory
    return previous


def build_sampler(cfg: Any, tokenizer: Any, *, role: Role = "eval", dist: Any = None,
                 model: torch.nn.Module | None = None, agent: AgentSpec | None = None
                 ) -> Sampler:
    """The sampler `cfg.rollout_engine` names (default `hf`), built for `role`; with `agent`
    (tools / an environment), the multi-turn `AgentSampler` over it."""
    name = getattr(cfg, "rollout_engine", "hf")
    if name not in SAMPLERS:
        raise ValueError(f"rollout_engine={name!r}: no such sampler; known: {sorted(SAMPLERS)}")
    sampler = SAMPLERS[name](cfg, tokenizer, role=role, dist=dist, model=model)
    if agent is None:
        return sampler
    return AgentSampler(sampler, agent, cfg.chat_template, getattr(cfg, "system_prompt", ""),
                       getattr(cfg, "tool_schemas", "template"),
                       getattr(cfg, "tool_call_parser", "auto"))
