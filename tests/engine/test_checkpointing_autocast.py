"""Activation checkpointing under bf16 autocast on the CPU (the learner's passes switch to eager
attention there): the backward's recomputation must run the same attention as the forward."""

from __future__ import annotations

import json

import pytest

from posttrain.models.loading import save_checkpoint
from posttrain.tasks.arithmetic import prompt_rows
from posttrain.tasks.tiny import build_tiny_llama, build_tiny_qwen2
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.grpo import GRPOTrainer


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_grpo_autocast_with_checkpointing_trains(tmp_path, family):
    """Failed before with CheckpointError ("Recomputed values ... different metadata"): the
    forward ran eager attention, the recomputation sdpa."""
    tok = build_char_tokenizer()
    build = build_tiny_llama if family == "llama" else build_tiny_qwen2
    extra = {} if family == "llama" else {"vocab_size": 256}
    model = build(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0,
                  **extra)
    save_checkpoint(model, tok, tmp_path / "m")
    GRPOTrainer(model=str(tmp_path / "m"), train_data=prompt_rows(16, 0),
                out_dir=str(tmp_path / "o"), max_steps=2, group_size=4, prompts_per_step=4,
                max_new_tokens=8, autocast_bf16=True, gradient_checkpointing=True,
                kl_coef=0.04, threads=1, progress=False, report_to=[], eval_size=0,
                rewards=[{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]).train()
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    assert len(steps) == 2
    assert abs(steps[0]["kl/token_mean"]) < 1e-6  # learner and reference took the same path
