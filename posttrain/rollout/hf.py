"""Sampling with a Hugging Face causal LM: the default rollout backend.

A lean decode loop over the model's KV cache instead of ``model.generate``: on small models the
per-token overhead of ``generate`` (logits processors, stopping criteria, bookkeeping) costs more
than the forward pass itself. The loop keeps what RL needs and ``generate`` does not return
cheaply: the log-prob of every sampled token under the full distribution at the sampling
temperature, and a truncation flag per sequence.

Notation: N sequences (B prompts x G samples), P prompt tokens, T new tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.models.logits import logits_context
from posttrain.rollout.kv_cache import RowsKV, cache_rows, can_carry, carry_rows, decode_cache
from posttrain.rollout.record import Rollout, pad_id

__all__ = ["Carried", "SamplingParams", "device_generator", "generate", "sample_tokens",
           "sample_turn", "stop_token_ids", "tokenize_prompts"]


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


def device_generator(
    generator: torch.Generator | None, device: torch.device | str
) -> torch.Generator | None:
    """A generator on `device`, derived deterministically from `generator`.

    A generator already on `device` is returned as is. Otherwise (e.g. the trainer's CPU
    generator while the model is on CUDA) one seed is drawn from `generator` (advancing it) and
    seeds a new generator on `device`: the same seed gives the same samples.
    """
    device = torch.device(device)
    if generator is None or generator.device == device:
        return generator
    if generator.device.type == device.type and device.index is None:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(device=device).manual_seed(seed)


def stop_token_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Every id that ends a completion: the model's ``generation_config.eos_token_id`` (an int
    or a list; chat models end a turn with e.g. Qwen's ``<|im_end|>``) plus the tokenizer's EOS.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    gen_eos = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
    found = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    ids: list[int] = []
    for i in [*found, tokenizer.eos_token_id]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument: ``cache`` (transformers 5) or ``past_key_values`` (4.x)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask logits outside top-k / the top-p nucleus with -inf. logits: [N, V] fp32."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # [N, V]
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        drop_sorted = (cum - probs) > top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def tokenize_prompts(tokenizer: Any, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and bool mask, [B, P]. Prompts are already rendered text."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    return enc["input_ids"], enc["attention_mask"].bool()


def _next_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
                uniforms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Pick the next token from logits [n, V]; return (tokens [n], log-probs [n] fp32).

    The log-prob is under the full distribution at the sampling temperature (before top-k /
    top-p truncation), which is what the learner recomputes; greedy decoding reports it at
    `params.temperature` too (1 when that is not positive). `uniforms` [n] in [0, 1): sample
    by inverse CDF with these draws instead of `torch.multinomial` (per-sequence seeding).
    """
    logits = logits.float()
    if params.greedy:
        tok = logits.argmax(-1)  # [n]
        if params.temperature > 0:
            logits = logits / params.temperature
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
    logits = logits / params.temperature
    logp_full = torch.log_softmax(logits, -1)  # [n, V]
    probs = _filter_logits(logits, params.top_k, params.top_p).softmax(-1)  # [n, V]
    if uniforms is None:
        tok = torch.multinomial(probs, 1, generator=generator)[:, 0]  # [n]
    else:
        cdf = probs.cumsum(-1)  # [n, V]; side=right never picks a zero-probability token
        draw = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]  # [n, 1]
        tok = torch.searchsorted(cdf, draw, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    return tok, logp_full.gather(-1, tok[:, None])[:, 0]


def sequence_uniforms(seeds: list[int], steps: int) -> Tensor:
    """[N, steps] uniform draws, row i from its own generator seeded with `seeds[i]`: the
    samples of a sequence do not depend on which other sequences share its batch (or rank)."""
    out = torch.empty((len(seeds), steps))
    gen = torch.Generator()
    for i, seed in enumerate(seeds):
        gen.manual_seed(seed)
        out[i] = torch.rand(steps, generator=gen)
    return out


@torch.no_grad()
def sample_tokens(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    eos_token_id: int | list[int],
    pad_token_id: int,
    autocast: bool = False,
    generator: torch.Generator | None = None,
    group_size: int = 1,
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Decode up to max_new_tokens for each of the N = B * group_size rows.

    `uniforms` [N, max_new_tokens]: per-row random draws (`sequence_uniforms`) used instead of
    `generator`.

    Two savings over a plain loop: each distinct prompt is prefilled once and its KV cache
    repeated `group_size` times, and rows that have finished are dropped from the batch (the
    cache is compacted) once a quarter of the running rows are done (checked every
    `sync_every` steps: each step on the CPU, every 8th on a GPU, so that decoding does not
    wait on the host at every token).

    Args:
        prompt_ids: [B, P] distinct left-padded prompts; prompt_mask: [B, P] bool.
    Returns:
        completion_ids [N, T], response_mask [N, T] bool (through EOS), logprobs [N, T] fp32
        (0 where masked), truncated [N] bool; rows are group-contiguous.

    `generator` may live on any device: a generator on the model's device is derived from it
    (`device_generator`). `eos_token_id` may list several stop ids (`stop_token_ids`).
    Logits come from the model's own forward inside `logits_context` (as in the learner).
    """
    # written in place, not grown by torch.cat (the copy was half of a decode step on the CPU)
    cache = decode_cache(model, prompt_ids.shape[1] + params.max_new_tokens)
    attn = prompt_mask.long()  # [B, P]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P]
    return _sample(model, cache, prompt_ids, attn, pos, params, eos_token_id, pad_token_id,
                   autocast, generator, group_size, uniforms)


def _sample(model: torch.nn.Module, cache: Any, ids: Tensor, attn: Tensor, pos: Tensor,
            params: SamplingParams, eos_token_id: int | list[int], pad_token_id: int,
            autocast: bool, generator: torch.Generator | None, group_size: int,
            uniforms: Tensor | None, limits: Tensor | None = None, parked: list | None = None
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_decode` on `cache` with the stop ids as a tensor, the generator on the model's device
    and the logits of `logits_context` (`sample_tokens`, `sample_turn`)."""
    if not params.greedy and params.temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {params.temperature}; "
                         "use greedy=True for argmax decoding")
    device = ids.device
    stops = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    eos = torch.as_tensor([i for i in stops if i is not None], dtype=torch.long, device=device)
    generator = None if params.greedy else device_generator(generator, device)
    cache_kw = {cache_kwarg(model): cache}
    # one region for prefill and every decode step: bf16 weight casts are cached
    with logits_context(model, autocast, device):
        return _decode(model, ids, attn, pos, params, eos, pad_token_id, generator,
                       group_size, cache, cache_kw, uniforms, limits, parked)


Carried = list[tuple[Tensor, RowsKV, Tensor]]
"""The cache of multi-turn sequences between turns (`sample_turn`): blocks of (the sequences'
keys [m], each layer's keys/values [m, H, L, D], valid columns [m, L] bool)."""


@torch.no_grad()
def sample_turn(
    model: torch.nn.Module,
    contexts: list[list[int]],
    keys: list[int],
    limits: list[int],
    params: SamplingParams,
    eos_token_id: int | list[int],
    pad_token_id: int,
    autocast: bool = False,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
    carried: Carried | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Carried | None]:
    """One turn of n multi-turn sequences, each continued on its KV cache of the last turn.

    `contexts[i]`: sequence i's ids so far (prompt, earlier turns, appended tool answers);
    `keys[i]`: its name from turn to turn; `limits[i]` >= 1: its most new tokens this turn;
    `uniforms` [n, max(limits)] as in `sample_tokens`. Only the tokens of a context that
    `carried` (the last turn's) does not hold are prefilled, on top of its cached rows; the
    rows of sequences not in `keys` are freed. The samples are `sample_tokens`' on the whole
    left-padded contexts, up to float rounding. A model whose cache cannot be carried
    (`can_carry`: sliding-window or recurrent layers) prefills every context at every turn.

    Returns `sample_tokens`' four (each row cut at its limit) and the cache for the next turn
    (None where it cannot be carried): each sequence's context and this turn's tokens but the
    last one, which the next turn prefills with what was appended after it. `carried` is
    consumed (emptied), so that its memory is freed while this turn decodes.
    """
    device = next(model.parameters()).device
    n, carried = len(contexts), carried or []
    where = {k: (p, r) for p, (ks, _, _) in enumerate(carried) for r, k in enumerate(ks.tolist())}
    picks = [where[k] for k in keys] if carried else []
    held = [valid.sum(1).tolist() for _, _, valid in carried]
    cached = [held[p][r] for p, r in picks] if carried else [0] * n
    chunks = [c[k:] for c, k in zip(contexts, cached, strict=True)]
    w = max(map(len, chunks))
    ids = torch.full((n, w), pad_token_id, dtype=torch.long)  # [n, w] left padded
    mask = torch.zeros((n, w), dtype=torch.long)
    for i, c in enumerate(chunks):
        ids[i, w - len(c):], mask[i, w - len(c):] = torch.tensor(c, dtype=torch.long), 1
    capacity = max(cached) + w + max(limits)
    if carried:
        cache, old = carry_rows(model, [(kv, v) for _, kv, v in carried], picks, capacity)
        carried.clear()  # consumed: the last turn's buffers are freed before this one decodes
    else:
        cache, old = decode_cache(model, capacity), torch.zeros((n, 0), dtype=torch.bool)
    attn = torch.cat([old.to(device).long(), mask.to(device)], 1)  # [n, L + w]
    pos = (torch.tensor(cached)[:, None] + mask.cumsum(1) - 1).clamp(min=0)  # [n, w]
    parked: list | None = [] if can_carry(cache) else None
    turn = dataclasses.replace(params, max_new_tokens=max(limits))
    out = _sample(model, cache, ids.to(device), attn, pos.to(device), turn, eos_token_id,
                  pad_token_id, autocast, generator, 1, uniforms,
                  torch.tensor(limits, device=device), parked)
    if parked is None:
        return (*out, None)
    fed = attn.shape[1] + out[1].sum(1) - 1  # [n] columns holding all but the last new token
    names = torch.tensor(keys, device=device)
    return (*out, [(names[r], kv, a.bool() & (torch.arange(a.shape[1], device=device)[None, :]
                                              < fed[r][:, None])) for r, kv, a in parked])


def sync_every(device: torch.device | str) -> int:
    """Decode steps between the loop's host syncs (the finished-row count that drives the
    break and the compaction): every step on the CPU, where reading a tensor costs nothing;
    every 8 steps on an accelerator, where each read stalls the launch queue (finished rows
    decode up to 7 steps longer, masked out)."""
    return 1 if torch.device(device).type == "cpu" else 8


def step_mask_4d(model: torch.nn.Module, device: torch.device | str) -> bool:
    """Whether decode steps hand the model a ready 4-D boolean mask ``[n, 1, 1, L]`` instead of
    the 2-D padding mask: on an accelerator (`sync_every` > 1), for sdpa attention on full-
    attention layers only (no sliding window, no hybrid layers). transformers reads a 2-D mask
    on the host at every step to decide whether sdpa may skip it; for one query position the
    4-D mask it would build is exactly this one."""
    if sync_every(device) == 1:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    cfg = getattr(base, "config", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if any(kind != "full_attention" for kind in getattr(cfg, "layer_types", None) or []):
        return False
    return not (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))


def _decode(model: torch.nn.Module, ids: Tensor, attn: Tensor, pos: Tensor,
            params: SamplingParams, eos: Tensor, pad_token_id: int,
            generator: torch.Generator | None, group_size: int, cache: Any,
            cache_kw: dict[str, Any], uniforms: Tensor | None = None,
            limits: Tensor | None = None, parked: list | None = None
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The prefill + decode loop of `sample_tokens` (runs inside its autocast region).

    ids [B, P'], pos [B, P']: the tokens to prefill after the cached columns and their position
    ids; attn [B, L + P']: the mask of the cached columns and of `ids`. `limits` [N]: each row's
    most new tokens (default max_new_tokens). `parked`: keep the cache of the rows that leave
    the batch, as (rows [m], their keys/values, attn [m, L']) blocks, the rows still running at
    the end last (`sample_turn`); else they are dropped.

    No host sync per token: the uniforms live on the model's device, every step writes the
    running rows' tokens and log-probs by index, the finished-row count is read every
    `sync_every` steps only, the step's attention mask is handed over ready
    (`step_mask_4d`), and lengths and EOS flags come from the tokens at the end.
    """
    device = ids.device
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                logits_to_keep=1, **cache_kw)
    logits = out.logits[:, -1, :].repeat_interleave(group_size, 0)  # [N, V]
    if group_size > 1:
        cache.batch_repeat_interleave(group_size)
        attn, pos = attn.repeat_interleave(group_size, 0), pos.repeat_interleave(group_size, 0)
    N, T = logits.shape[0], params.max_new_tokens
    limits = torch.full((N,), T, device=device) if limits is None else limits.to(device)
    every, mask_4d = sync_every(device), step_mask_4d(model, device)
    tokens = torch.full((N, T), pad_token_id, dtype=torch.long, device=device)  # [N, T]
    logprobs = torch.zeros((N, T), device=device)  # [N, T]
    u_all = uniforms.to(device) if uniforms is not None else None  # [N, T]
    rows = torch.arange(N, device=device)  # [n] original index of each running row
    alive = torch.ones(N, dtype=torch.bool, device=device)  # [n] no EOS sampled yet
    pos = pos[:, -1:]  # [n, 1]
    top = pos + limits[:, None] - 1  # [n, 1] the last position a row feeds (within its limit)
    for t in range(T):
        u = u_all[rows, t] if u_all is not None else None  # [n]
        tok, lp = _next_token(logits, params, generator, u)  # [n], [n]
        tokens[rows, t], logprobs[rows, t] = tok, lp
        alive = alive & ~torch.isin(tok, eos) & (limits[rows] > t + 1)  # [n]
        if t == T - 1:
            break
        if (t + 1) % every == 0:  # the one host sync: stop, or drop the finished rows
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if 4 * (rows.numel() - n_alive) >= rows.numel():
                keep, gone = alive.nonzero()[:, 0], (~alive).nonzero()[:, 0]  # [n'], [n - n']
                if parked is not None:
                    parked.append((rows[gone], cache_rows(cache, gone), attn[gone]))
                cache.batch_select_indices(keep)
                rows, tok, attn, pos, top, alive = (rows[keep], tok[keep], attn[keep],
                                                    pos[keep], top[keep], alive[keep])
        # finished rows not yet compacted away run on (not past their last position) and
        # their samples are masked out
        attn = torch.cat([attn, torch.ones_like(tok)[:, None]], dim=1)  # [n, P+t+1]
        pos = torch.minimum(pos + 1, top)
        mask = attn.bool()[:, None, None, :] if mask_4d else attn  # [n, 1, 1, L] or [n, L]
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                    use_cache=True, **cache_kw)
        logits = out.logits[:, -1, :]  # [n, V]
    if parked is not None:
        parked.append((rows, cache_rows(cache), attn))
    return _finish(tokens, logprobs, eos, pad_token_id, limits)


def _finish(tokens: Tensor, logprobs: Tensor, eos: Tensor, pad_token_id: int,
            limits: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Masks from the sampled tokens [N, T]: each row ends at its first stop id (inclusive) or
    after its limit [N] of tokens (default T).

    Returns tokens and log-probs (pad / 0 outside the mask) and the mask, cut to the longest
    row, and truncated [N] (no stop id sampled within the limit)."""
    N, T = tokens.shape
    limits = torch.full((N,), T, device=tokens.device) if limits is None else limits
    steps = torch.arange(T, device=tokens.device)[None, :]  # [1, T]
    first = torch.where(torch.isin(tokens, eos), steps, T).amin(1) if T else \
        torch.zeros(N, dtype=torch.long, device=tokens.device)  # [N] first stop (T: none)
    ended = first < limits  # [N]
    response_mask = (steps <= first[:, None]) & (steps < limits[:, None])  # [N, T]
    tokens = tokens.masked_fill(~response_mask, pad_token_id)
    logprobs = logprobs.masked_fill(~response_mask, 0.0)
    used = int(response_mask.any(0).sum()) if N else 0
    return tokens[:, :used], response_mask[:, :used], logprobs[:, :used], ~ended


def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    *,
    group_size: int = 1,
    rows: list[dict[str, Any]] | None = None,
    params: SamplingParams | None = None,
    autocast: bool = False,
    generator: torch.Generator | None = None,
    batch_size: int = 0,
    seeds: list[int] | None = None,
    stop_ids: list[int] | None = None,
) -> Rollout:
    """Sample `group_size` completions for each rendered prompt: the rollout entry point.

    Returns a group-contiguous Rollout of N = len(prompts) * group_size sequences.
    `batch_size` > 0 splits the N sequences into generation batches of that many rows.
    A completion ends at the first of `stop_ids` (default `stop_token_ids(model, tokenizer)`).
    `generator` may be a CPU generator while the model is on another device.
    `seeds` (N, group-contiguous): each sequence samples from its own generator, so its tokens
    do not depend on the batch or rank it is generated in; else `generator` draws for all.
    """
    if seeds is not None and len(seeds) != len(prompts) * group_size:
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts) * group_size} "
                         "sequences")
    params = params or SamplingParams()
    was_training = model.training
    model.eval()
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts)  # [B, P]
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    eos = list(stop_ids) if stop_ids is not None else stop_token_ids(model, tokenizer)
    pad = pad_id(tokenizer, eos)
    generator = None if params.greedy else device_generator(generator, device)
    parts = []
    per_batch = max(1, batch_size // group_size) if batch_size > 0 else 0
    uniforms = (sequence_uniforms(seeds, params.max_new_tokens) if seeds is not None
                else None)  # [N, T]
    for sl in _batches(prompt_ids.shape[0], per_batch):
        pid, pm = _trim_left(prompt_ids[sl], prompt_mask[sl])
        u = (uniforms[sl.start * group_size: sl.stop * group_size] if uniforms is not None
             else None)
        parts.append(sample_tokens(model, pid, pm, params, eos, pad, autocast, generator,
                                   group_size, u))
    if was_training:
        model.train()
    completions, logprobs, truncated = [], [], []
    for ids, mask, lps, trunc in parts:
        n = mask.sum(1).tolist()  # each row's mask is a prefix: through its stop id
        completions += [row[:k] for row, k in zip(ids.tolist(), n, strict=True)]
        logprobs += [row[:k] for row, k in zip(lps.tolist(), n, strict=True)]
        truncated += trunc.tolist()
    prompt_lists = [ids[m].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
    return Rollout.from_sequences(
        [p for p in prompt_lists for _ in range(group_size)], completions, logprobs, truncated,
        group_size=group_size, pad_token_id=pad, tokenizer=tokenizer,
        rows=[r for r in (rows or [{}] * len(prompts)) for _ in range(group_size)])


def _batches(n: int, batch_size: int) -> Iterator[slice]:
    step = batch_size if batch_size > 0 else n
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _trim_left(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Drop leading columns that are padding in every row. [n, P] -> [n, P']."""
    keep = mask.any(0)
    first = int(keep.nonzero()[0]) if bool(keep.any()) else 0
    return ids[:, first:], mask[:, first:]
