"""Supervised fine-tuning on prompt/completion pairs: the warm start before RL.

Each row ``{"prompt", "completion"}`` becomes ``render_prompt(prompt) + completion + EOS``; the
loss is the mean negative log-likelihood of the completion tokens only (prompt and padding are
masked out by ``response_mask``), averaged over all completion tokens of the optimizer batch, so
splitting a batch into micro-batches gives the same gradient. AdamW with linear warm-up and a
cosine / linear / constant schedule, gradient clipping, optional bf16 autocast.

Padding: rows are right padded only to the longest row of their batch, and batches are formed
from windows of similar-length rows (shuffle, sort within a window, shuffle the batches), so
almost no compute goes to padding. ``torch.set_num_threads`` is left to the caller.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from posttrain.data.prompts import render_prompt
from posttrain.ops import token_logprobs
from posttrain.ops.masked import masked_count, masked_sum

Example = tuple[list[int], int]  # (input_ids, prompt_len)


def tokenize_sft_rows(tokenizer: Any, rows: list[dict], max_len: int) -> tuple[list[Example], int]:
    """Token ids of ``prompt + completion + eos`` cut to ``max_len``, and the prompt length.

    Returns the examples and how many rows were dropped because no completion token fit.
    """
    prompts = [render_prompt(tokenizer, r["prompt"]) for r in rows]
    completions = [r["completion"] for r in rows]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    examples: list[Example] = []
    for p, c in zip(p_ids, c_ids, strict=True):
        if len(p) >= max_len:
            continue
        examples.append(((p + c + eos)[:max_len], len(p)))
    return examples, len(rows) - len(examples)


def collate_sft(examples: list[Example], pad_id: int) -> dict[str, Tensor]:
    """Right-pad to the longest example.

    Returns input_ids [B, L], attention_mask [B, L] and response_mask [B, L] (True on
    completion tokens: the positions the loss is taken on).
    """
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros((len(examples), width), dtype=torch.bool)  # [B, L]
    response_mask = torch.zeros((len(examples), width), dtype=torch.bool)  # [B, L]
    for i, (ids, prompt_len) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = True
        response_mask[i, prompt_len : len(ids)] = True
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "response_mask": response_mask}


def sft_nll_sum(model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Summed NLL of the completion tokens of ``batch`` and their count.

    ``logits[:, t]`` predicts ``input_ids[:, t + 1]``, so the mask is shifted the same way.
    """
    input_ids, response_mask = batch["input_ids"], batch["response_mask"]  # [B, L]
    logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"].long()).logits
    logprobs = token_logprobs(logits[:, :-1], input_ids[:, 1:])  # [B, L-1]
    mask = response_mask[:, 1:]  # [B, L-1]
    return -masked_sum(logprobs.float(), mask), masked_count(mask)


def backward_batch(model: torch.nn.Module, parts: list[dict[str, Tensor]],
                   autocast: bool = False) -> Tensor:
    """Accumulate the gradient of the batch's mean completion-token NLL over its micro-batches.

    Each micro-batch's summed NLL is divided by the completion-token count of the WHOLE batch,
    so the accumulated gradient equals that of one pass over the full batch. Returns the
    (detached) mean NLL.
    """
    n_tokens = sum(masked_count(p["response_mask"][:, 1:]) for p in parts).clamp(min=1.0)
    total = torch.zeros(())
    for part in parts:
        with _autocast(autocast):
            nll, _ = sft_nll_sum(model, part)
        (nll / n_tokens).backward()
        total += nll.detach()
    return total / n_tokens


def length_grouped_batches(
    lengths: list[int], batch_size: int, rng: random.Random, window: int = 32
) -> list[list[int]]:
    """One epoch of batches: shuffle, sort windows of ``window`` batches by length, shuffle."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    span = batch_size * window
    batches = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _batch_stream(lengths: list[int], batch_size: int, seed: int) -> Iterator[list[int]]:
    rng = random.Random(seed)
    while True:
        yield from length_grouped_batches(lengths, batch_size, rng)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decays = {
        "constant": lambda p: 1.0,
        "linear": lambda p: 1.0 - p,
        "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    }
    if schedule not in decays:
        raise ValueError(f"unknown lr schedule {schedule!r}; valid: {sorted(decays)}")
    return min_ratio + (1.0 - min_ratio) * decays[schedule](progress)


def _autocast(enabled: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def train_sft(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup: int = 100,
    weight_decay: float = 0.0,
    max_len: int = 128,
    seed: int = 0,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.1,
    max_grad_norm: float = 1.0,
    micro_batch_size: int | None = None,
    autocast: bool = False,
    log_every: int = 1,
    log_fn: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place on ``rows`` (``{"prompt", "completion"}``).

    Runs ``steps`` optimizer steps. ``log_fn(step, metrics)`` is called every ``log_every``
    steps (and on the last) with ``loss/sft``, ``lr``, ``grad_norm``, ``perf/tokens`` and
    ``perf/seconds``. Returns ``{"steps", "loss_first", "loss_last", "losses", "seconds",
    "tokens", "skipped_rows"}``; losses are the per-step mean completion-token NLL and
    ``loss_last`` averages the last 10% of steps.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    examples, skipped = tokenize_sft_rows(tokenizer, rows, max_len)
    if not examples:
        raise ValueError(f"no SFT row has a completion token within max_len={max_len}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    micro = micro_batch_size or batch_size
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, steps, warmup, schedule, min_lr_ratio))
    batches = _batch_stream([len(ids) for ids, _ in examples], batch_size, seed)
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        # 1. one batch of similar-length rows, split into micro-batches
        idx = next(batches)
        parts = [collate_sft([examples[i] for i in idx[a : a + micro]], pad_id)
                 for a in range(0, len(idx), micro)]
        # 2. forward/backward, normalised by the batch's completion tokens
        loss = backward_batch(model, parts, autocast)
        # 3. clip, step, schedule
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
        step_lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        tokens += int(sum(p["attention_mask"].sum() for p in parts))
        if log_fn is not None and (step % log_every == 0 or step == steps - 1):
            log_fn(step, {"loss/sft": losses[-1], "lr": step_lr,
                          "grad_norm": float(grad_norm), "perf/tokens": float(tokens),
                          "perf/seconds": time.perf_counter() - start})
    model.eval()
    tail = max(1, steps // 10)
    return {"steps": steps, "loss_first": losses[0], "loss_last": sum(losses[-tail:]) / tail,
            "losses": losses, "seconds": time.perf_counter() - start, "tokens": tokens,
            "skipped_rows": skipped}
