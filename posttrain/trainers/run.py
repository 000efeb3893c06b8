"""Entry points behind the CLI: each validates, trains or evaluates, and writes summary.json."""

from __future__ import annotations

import time
from typing import Any

from posttrain.config import ConfigError, DPOConfig, GRPOConfig, SFTConfig
from posttrain.trainers.common import (
    MetricsLogger,
    merged,
    save_checkpoint,
    save_config,
    set_seed,
    setup_threads,
    write_summary,
)
from posttrain.trainers.session import Session, load_session
from posttrain.trainers.sft import train_sft


def run_sft(cfg: SFTConfig, session: Session | None = None) -> dict[str, Any]:
    """Supervised warm start on {prompt, completion} rows; loss on completion tokens only."""
    start = time.time()
    setup_threads(cfg.threads)
    set_seed(cfg.seed)
    s = session or load_session(cfg, kind="sft")
    check_lengths(s, cfg.max_len)
    s.maybe_lora()
    save_config(cfg.out_dir, cfg)
    logger = MetricsLogger(cfg.out_dir)
    eval_before = s.evaluate(s.model)
    with s.progress(cfg.max_steps, "sft") as bar:

        def log_fn(step: int, metrics: dict[str, float]) -> None:
            if step % cfg.log_every == 0:
                logger.log(step, metrics)
            bar.update(loss=metrics.get("loss/sft"))

        train_metrics = train_sft(
            s.model, s.tokenizer, s.train_rows, steps=cfg.max_steps, batch_size=cfg.batch_size,
            lr=cfg.lr, warmup=cfg.warmup_steps, weight_decay=cfg.weight_decay,
            max_len=cfg.max_len, seed=cfg.seed, log_fn=log_fn, schedule=cfg.lr_schedule,
            max_grad_norm=cfg.max_grad_norm, autocast=cfg.autocast_bf16)
    eval_after = s.evaluate(s.model)
    logger.close()
    save_checkpoint(merged(s.model), s.tokenizer, f"{cfg.out_dir}/final")
    summary = {"eval_before": eval_before.get("accuracy"), "eval_after": eval_after.get("accuracy"),
               "eval_before_detail": eval_before, "eval_after_detail": eval_after,
               "train": train_metrics, "seconds": round(time.time() - start, 1)}
    write_summary(cfg.out_dir, cfg, **summary)
    return summary


def check_lengths(s: Session, max_len: int) -> None:
    """Rows longer than max_len are an error naming the first such row, never silently cut."""
    texts = [s.render(r["prompt"]) + r["completion"] for r in s.train_rows]
    lengths = [len(ids) + 1 for ids in s.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    too_long = [i for i, n in enumerate(lengths) if n > max_len]
    if too_long:
        i = too_long[0]
        raise ConfigError(
            f"config key 'max_len'={max_len}: {len(too_long)} SFT rows are longer (row {i + 1} "
            f"of {s.cfg.train_data} has {lengths[i]} tokens); raise max_len or shorten the data")


def run_grpo(cfg: GRPOConfig, session: Session | None = None) -> dict[str, Any]:
    from posttrain.trainers.grpo import GRPOTrainer

    return GRPOTrainer(cfg, session).train()


def run_dpo(cfg: DPOConfig, session: Session | None = None) -> dict[str, Any]:
    from posttrain.trainers.dpo import DPOTrainer

    return DPOTrainer(cfg, session).train()


def run_eval(cfg: GRPOConfig) -> dict[str, Any]:
    """Greedy held-out evaluation of `model` with the configured rewards (no training)."""
    start = time.time()
    setup_threads(cfg.threads)
    if not cfg.eval_data:
        raise ConfigError("config key 'eval_data': required by `posttrain eval`")
    s = load_session(cfg, kind="prompts", with_train=False)
    result = s.evaluate(s.model)
    write_summary(cfg.out_dir, cfg, eval_before=result.get("accuracy"),
                  eval_after=result.get("accuracy"), eval_detail=result,
                  seconds=round(time.time() - start, 1))
    return result
