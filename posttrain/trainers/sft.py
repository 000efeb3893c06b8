"""Supervised fine-tuning on prompt/completion pairs: the warm start before RL.

Each row ``{"prompt", "completion"}`` becomes ``render_prompt(prompt) + completion + EOS``; the
loss is the mean negative log-likelihood of the completion tokens only (prompt and padding are
masked out by ``response_mask``), averaged over all completion tokens of the optimizer batch, so
splitting a batch into micro-batches gives the same gradient. Optimizer, schedule, logging,
evaluation and checkpoints come from the shared :class:`~posttrain.trainers.base.Trainer`.

Padding: rows are right padded only to the longest row of their batch, and batches are formed
from windows of similar-length rows (shuffle, sort within a window, shuffle the batches), so
almost no compute goes to padding.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from posttrain.config import ConfigError, SFTConfig
from posttrain.data.prompts import render_prompt
from posttrain.ops import token_logprobs
from posttrain.ops.masked import masked_count, masked_sum
from posttrain.rollout.hf import autocast_ctx
from posttrain.trainers.base import Trainer

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


def collate_sft(examples: list[Example], pad_id: int,
                device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Right-pad to the longest example, on `device`.

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
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "response_mask": response_mask}
    return {k: v.to(device) for k, v in batch.items()}


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
    total = torch.zeros((), device=n_tokens.device)
    for part in parts:
        with autocast_ctx(autocast, n_tokens.device):
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


def _batch_stream(lengths: list[int], batch_size: int, seed: int) -> Iterator[list[int]]:
    rng = random.Random(seed)
    while True:
        yield from length_grouped_batches(lengths, batch_size, rng)


class SFTTrainer(Trainer):
    """Supervised fine-tuning on {prompt, completion} rows; loss on completion tokens only."""

    name = "sft"
    config_class = SFTConfig
    data_kind = "sft"
    progress_keys = ("loss/sft",)
    cfg: SFTConfig

    def setup(self) -> None:
        cfg, tok = self.cfg, self.tokenizer
        self.examples, _ = tokenize_sft_rows(tok, self.s.train_rows, max_len=2**31)  # uncut
        too_long = [i for i, (ids, _) in enumerate(self.examples) if len(ids) > cfg.max_seq_len]
        if too_long:  # an error naming the first such row, never silently cut
            i = too_long[0]
            raise ConfigError(
                f"config key 'max_seq_len'={cfg.max_seq_len}: {len(too_long)} SFT rows are "
                f"longer (row {i + 1} of {cfg.train_data} has {len(self.examples[i][0])} "
                "tokens); raise max_seq_len or shorten the data")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.batches = _batch_stream([len(ids) for ids, _ in self.examples], cfg.batch_size,
                                     cfg.seed)
        self.tokens = 0
        self.losses: list[float] = []

    def step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        # 1. one batch of similar-length rows, split into micro-batches, on the model's device
        idx = next(self.batches)
        micro = cfg.micro_batch_size or cfg.batch_size
        parts = [collate_sft([self.examples[i] for i in idx[a: a + micro]], self.pad_id,
                             self.device) for a in range(0, len(idx), micro)]
        # 2. forward/backward, normalised by the batch's completion tokens
        loss = backward_batch(self.model, parts, cfg.autocast_bf16)
        lr = self.sched.get_last_lr()[0]
        # 3. clip, step, schedule
        grad_norm = self.optimizer_step()
        self.tokens += int(sum(p["attention_mask"].sum() for p in parts))
        self.losses.append(float(loss))
        return {"loss/sft": float(loss), "train/lr": lr, "train/grad_norm": grad_norm,
                "perf/tokens": float(self.tokens)}

    def summary_fields(self) -> dict[str, Any]:
        """`train`: first loss, mean of the last 10% of step losses, tokens seen."""
        tail = self.losses[-max(1, len(self.losses) // 10):] or [float("nan")]
        return {"train": {"loss_first": self.losses[0] if self.losses else float("nan"),
                          "loss_last": sum(tail) / len(tail), "tokens": self.tokens}}
