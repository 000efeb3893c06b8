"""Supervised fine-tuning on prompt/completion pairs: the warm start before RL.

Each row ``{"prompt", "completion"}`` (or conversational: ``{"messages"}``, trained on its last
assistant turn, or prompt and completion as chat messages; docs/trainers.md "Data formats")
becomes ``render_prompt(prompt) + completion + EOS``; the
loss is the mean negative log-likelihood of the completion tokens only (prompt and padding are
masked out by ``response_mask``), averaged over all completion tokens of the optimizer batch, so
splitting a batch into micro-batches gives the same gradient. Optimizer, schedule, logging,
evaluation and checkpoints come from the shared :class:`~posttrain.engine.trainer.Trainer`.

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
from posttrain.data.prompts import tokenize_completions
from posttrain.engine.forward import DEFAULT_FORWARD, PolicyForward
from posttrain.engine.trainer import Trainer
from posttrain.engine.update import shard_plan
from posttrain.engine.values import completion_values
from posttrain.ops.masked import masked_count, masked_sum

Example = tuple[list[int], int]  # (input_ids, prompt_len)


def tokenize_sft_rows(tokenizer: Any, rows: list[dict], max_len: int,
                      template: str = "auto") -> tuple[list[Example], int]:
    """Token ids of ``prompt + completion + eos`` cut to ``max_len``, and the prompt length
    (a conversational completion is the chat template's rendering of its assistant turn,
    `posttrain.data.prompts.render_completion`).

    Returns the examples and how many rows were dropped because no completion token fit.
    """
    p_ids, c_ids = tokenize_completions(tokenizer, rows, "completion", template)
    examples: list[Example] = []
    for p, c in zip(p_ids, c_ids, strict=True):
        if len(p) >= max_len:
            continue
        examples.append(((p + c)[:max_len], len(p)))
    return examples, len(rows) - len(examples)


def collate_sft(examples: list[Example], pad_id: int,
                device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Split each example at its prompt length: prompts left padded, completions right padded
    (the layout of every trainer's forward, `posttrain.engine.forward`), on `device`.

    Returns prompt_ids, prompt_mask [B, P] and completion_ids, response_mask [B, T] (True on
    completion tokens: the positions the loss is taken on).
    """
    P = max(n for _, n in examples)
    T = max(len(ids) - n for ids, n in examples)
    prompt_ids = torch.full((len(examples), P), pad_id, dtype=torch.long)  # [B, P]
    prompt_mask = torch.zeros((len(examples), P), dtype=torch.bool)  # [B, P]
    completion_ids = torch.full((len(examples), T), pad_id, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros((len(examples), T), dtype=torch.bool)  # [B, T]
    for i, (ids, n) in enumerate(examples):
        prompt_ids[i, P - n:] = torch.tensor(ids[:n], dtype=torch.long)
        prompt_mask[i, P - n:] = True
        completion_ids[i, : len(ids) - n] = torch.tensor(ids[n:], dtype=torch.long)
        response_mask[i, : len(ids) - n] = True
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
             "completion_ids": completion_ids, "response_mask": response_mask}
    return {k: v.to(device) for k, v in batch.items()}


def sft_nll_sum(model: torch.nn.Module, batch: dict[str, Tensor],
                forward: PolicyForward = DEFAULT_FORWARD) -> tuple[Tensor, Tensor]:
    """Summed NLL of the completion tokens of ``batch`` and their count, through the one
    policy forward (the LM head only on completion positions, fused and fp32 where
    supported, so no fp32 ``[B, L, V]`` logits)."""
    mask = batch["response_mask"]  # [B, T]
    logprobs, _ = forward.logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                   batch["completion_ids"], mask)  # [B, T]
    return -masked_sum(logprobs, mask), masked_count(mask)


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


class BatchStream(Iterator[list[int]]):
    """Endless batches of row indices, one length-grouped epoch after another.

    Its position (the rng and what is left of the current epoch) is part of a checkpoint.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int) -> None:
        self.lengths, self.batch_size = lengths, batch_size
        self.rng = random.Random(seed)
        self.pending: list[list[int]] = []

    def __next__(self) -> list[int]:
        if not self.pending:
            self.pending = length_grouped_batches(self.lengths, self.batch_size, self.rng)[::-1]
        return self.pending.pop()

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "pending": [list(b) for b in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])
        self.pending = [list(b) for b in state["pending"]]


class SFTTrainer(Trainer):
    """Supervised fine-tuning on {prompt, completion} rows; loss on completion tokens only."""

    name = "sft"
    supports_packing = True  # every forward is the one policy forward
    config_class = SFTConfig
    run_values = staticmethod(completion_values)
    data_kind = "sft"
    progress_keys = ("loss/sft",)
    shares_prompts = False
    cfg: SFTConfig

    def validate(self) -> None:
        if self.cfg.batch_size % self.dist.world:
            raise ConfigError(f"config key 'batch_size'={self.cfg.batch_size}: must be a "
                              f"multiple of the {self.dist.world} torchrun processes (each "
                              "takes an equal share of every batch)")

    def setup(self) -> None:
        cfg, tok = self.cfg, self.tokenizer
        self.examples, _ = tokenize_sft_rows(tok, self.session.train_rows, max_len=2**31,  # uncut
                                             template=cfg.chat_template)
        too_long = [i for i, (ids, _) in enumerate(self.examples) if len(ids) > cfg.max_seq_len]
        if too_long:  # an error naming the first such row, never silently cut
            i = too_long[0]
            raise ConfigError(
                f"config key 'max_seq_len'={cfg.max_seq_len}: {len(too_long)} SFT rows are "
                f"longer (row {i + 1} of {cfg.train_data} has {len(self.examples[i][0])} "
                "tokens); raise max_seq_len or shorten the data")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.batches = BatchStream([len(ids) for ids, _ in self.examples], cfg.batch_size,
                                   cfg.seed)
        self.tokens = 0
        self.losses: list[float] = []

    def step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        # 1. one batch of similar-length rows (every rank draws the same), the engine shards it
        batch = next(self.batches)
        plan = shard_plan(len(batch), self.dist, cfg.micro_batch_size or cfg.batch_size)
        examples = [self.examples[batch[g]] for g in plan.global_ids]  # this rank's rows

        def counts(pos: list[int]) -> dict[str, float]:
            return {"tokens": float(sum(len(examples[i][0]) - examples[i][1] for i in pos))}

        def loss_fn(pos: list[int], totals: dict[str, float]) -> tuple[Tensor, dict, float]:
            part = collate_sft([examples[i] for i in pos], self.pad_id, self.device)
            nll, n = sft_nll_sum(self.model, part, self.forward)
            loss = nll / max(totals["tokens"], 1.0)  # the whole batch's mean token NLL
            return loss, {"loss/sft": loss.detach()}, float(n)

        # 2. forward/backward per micro-batch; 3. sum gradients over ranks, clip, step
        out = self.optimize(plan, counts, loss_fn)
        out.pop("train/optimizer_steps", None)
        self.tokens += sum(len(self.examples[i][0]) for i in batch)
        self.losses.append(out["loss/sft"])
        return {**out, "perf/tokens": float(self.tokens)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "batches": self.batches.state_dict(),
                "tokens": self.tokens, "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.batches.load_state_dict(state["batches"])
        self.tokens, self.losses = int(state["tokens"]), list(state["losses"])

    def summary_fields(self) -> dict[str, Any]:
        """`train`: first loss, mean of the last 10% of step losses, tokens seen."""
        tail = self.losses[-max(1, len(self.losses) // 10):] or [float("nan")]
        return {"train": {"loss_first": self.losses[0] if self.losses else float("nan"),
                          "loss_last": sum(tail) / len(tail), "tokens": self.tokens}}
