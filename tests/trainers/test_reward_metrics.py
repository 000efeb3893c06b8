"""`reward/accuracy` is the verifier's verdict, not "weighted score >= 1.0" (GRPO and PPO)."""

from __future__ import annotations

import math

from posttrain.config import GRPOConfig, PPOConfig, build_config
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.ppo import PPOTrainer
from posttrain.trainers.prompt_rl import accuracy_metrics

ONE = {"name": "tests.trainers.toy_rewards:always_one", "weight": 1.0}
MATH0 = {"name": "math", "weight": 0.0}  # the verifier, measured but not trained on


def test_accuracy_metrics_split_score_and_verdict():
    out = accuracy_metrics([1.0, 0.5, float("nan"), 2.0], [0.0, 1.0, float("nan"), 0.0])
    assert out == {"reward/frac_score_ge_1": 2 / 3, "reward/accuracy": 1 / 3}
    assert "reward/accuracy" not in accuracy_metrics([1.0], None)


def _base(world: dict[str, str], out: str, rewards: list[dict]) -> dict:
    return {"model": world["model"], "train_data": world["data"], "out_dir": out,
            "rewards": rewards, "group_size": 2, "prompts_per_step": 4, "max_new_tokens": 4,
            "max_steps": 1, "progress": False, "threads": 1, "report_to": []}


def test_grpo_custom_reward_is_not_accuracy(toy_world, tmp_path):
    """A reward that is 1.0 everywhere once showed reward/accuracy 1.0; the random policy
    answers no '7' in <answer> tags, so the verifier's accuracy is 0."""
    cfg = build_config(GRPOConfig, overrides=_base(toy_world, str(tmp_path / "a"), [ONE, MATH0]))
    _, metrics = GRPOTrainer(cfg).rollout_step()
    assert metrics["reward/frac_score_ge_1"] == 1.0
    assert metrics["reward/accuracy"] == 0.0
    cfg = build_config(GRPOConfig, overrides=_base(toy_world, str(tmp_path / "b"), [ONE]))
    _, metrics = GRPOTrainer(cfg).rollout_step()
    assert "reward/accuracy" not in metrics and metrics["reward/frac_score_ge_1"] == 1.0


def test_ppo_custom_reward_is_not_accuracy(toy_world, tmp_path):
    over = {**_base(toy_world, str(tmp_path / "a"), [ONE, MATH0]), "micro_batch_size": 8}
    _, _, metrics = PPOTrainer(build_config(PPOConfig, overrides=over)).rollout_and_score()
    assert metrics["reward/frac_score_ge_1"] == 1.0 and metrics["reward/accuracy"] == 0.0
    over = {**over, "rewards": [ONE], "out_dir": str(tmp_path / "b")}
    _, _, metrics = PPOTrainer(build_config(PPOConfig, overrides=over)).rollout_and_score()
    assert "reward/accuracy" not in metrics
    assert not math.isnan(metrics["reward/frac_score_ge_1"])
