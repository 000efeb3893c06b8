"""The Python API as a TRL user writes it (issue 24, item 4)."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, DPOConfig, GRPOConfig
from posttrain.models import load_model_and_tokenizer
from posttrain.trainers.grpo import GRPOTrainer


def sevens(completion: str) -> float:
    return sum(ch == "7" for ch in completion[:8]) / 8.0


def test_config_object_together_with_objects(toy_world, tmp_path):
    model, tok = load_model_and_tokenizer(toy_world["model"])
    rows = [{"prompt": c, "answer": "7"} for c in "abcdefgh"]
    cfg = GRPOConfig(group_size=4, prompts_per_step=4, max_new_tokens=8, lr=1e-2, max_steps=1,
                     progress=False, threads=1, report_to="none", out_dir=str(tmp_path))
    trainer = GRPOTrainer(cfg, model=model, tokenizer=tok, train_data=rows, rewards=[sevens])
    assert trainer.model is model and trainer.cfg.group_size == 4
    assert trainer.cfg.rewards == [{"name": "sevens", "weight": 1.0}]
    _, metrics = trainer.rollout_step()
    assert metrics["reward/errors/sevens"] == 0.0
    # config keys beside a config object are overrides, checked like any other
    with pytest.raises(ConfigError, match="group_size"):
        GRPOTrainer(cfg, model=model, tokenizer=tok, train_data=rows, group_size=1)
    with pytest.raises(ConfigError, match="takes a GRPOConfig, got a DPOConfig"):
        GRPOTrainer(DPOConfig(), model=model, tokenizer=tok, train_data=rows)
