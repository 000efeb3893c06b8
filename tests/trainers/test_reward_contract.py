"""The reward contract in a trainer (issue 24, items 1-3 and 11): checked before any model
loads, TRL-style batched rewards, and a broken reward stopping the run instead of training on
zeros."""

from __future__ import annotations

import json

import pytest

from posttrain.config import ConfigError
from posttrain.data import DataError
from posttrain.rewards import RewardFunctionError
from posttrain.trainers.grpo import GRPOTrainer

KEYS = {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8, "lr": 1e-2,
        "max_steps": 1, "progress": False, "seed": 0, "threads": 1, "report_to": []}


def trl_sevens(completions, **kwargs):
    """TRL's form: one call per batch, a list back."""
    return [sum(ch == "7" for ch in c[:8]) / 8.0 + 0.25 for c in completions]


def broken(completion, answer):
    raise RuntimeError("always fails")


def test_a_misspelt_entry_key_fails_before_the_model_loads(toy_world, tmp_path):
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(model="/nonexistent", train_data=toy_world["data"], out_dir=str(tmp_path),
                    rewards=[{"name": "math", "wieght": 2}], **KEYS)
    assert "'wieght'" in str(err.value) and "Did you mean 'weight'?" in str(err.value)


def test_a_field_a_reward_needs_is_checked_in_every_row(toy_world, tmp_path):
    with pytest.raises(DataError) as err:
        GRPOTrainer(model="/nonexistent", train_data=toy_world["data"], out_dir=str(tmp_path),
                    rewards=["math"], answer_field="soluton", **KEYS)
    first = str(err.value).splitlines()[0]
    assert first == (f"{toy_world['data']}:1: field 'soluton': missing (reward 'math' needs it "
                     "as 'answer': answer_field=soluton) (missing from 72 rows)")
    # held-out rows too: one row without `answer`, on line 2
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "a", "answer": "7"}) + "\n"
                       + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(DataError, match=r"heldout.jsonl:2: field 'answer': missing \(reward "
                                        r"'math' needs it\)"):
        GRPOTrainer(model="/nonexistent", train_data=toy_world["data"], out_dir=str(tmp_path),
                    eval_data=str(heldout), rewards=["math"], **KEYS)


def test_trl_batched_reward_scores_a_grpo_step(toy_world, tmp_path):
    trainer = GRPOTrainer(model=toy_world["model"], train_data=toy_world["data"],
                          out_dir=str(tmp_path), rewards=[trl_sevens], **KEYS)
    _, metrics = trainer.rollout_step()
    assert metrics["reward/errors/trl_sevens"] == 0.0
    assert metrics["reward/mean"] >= 0.25


def test_a_reward_that_always_fails_stops_the_run(toy_world, tmp_path):
    trainer = GRPOTrainer(model=toy_world["model"], train_data=toy_world["data"],
                          out_dir=str(tmp_path / "a"), rewards=[broken], **KEYS)
    with pytest.raises(RewardFunctionError, match=r"'broken' failed on sample 0: "
                                                  r"RuntimeError\('always fails'\); completion: "):
        trainer.rollout_step()
    # reward_on_error: zero keeps the old behaviour (scored 0, counted)
    zero = GRPOTrainer(model=toy_world["model"], train_data=toy_world["data"],
                       out_dir=str(tmp_path / "b"), rewards=[broken], reward_on_error="zero",
                       **KEYS)
    _, metrics = zero.rollout_step()
    assert metrics["reward/errors/broken"] == 16.0 and metrics["reward/mean"] == 0.0
