"""One run per out_dir: a fresh run into an earlier one is refused unless `resume_from` or
`overwrite`; a resume says where it resumed and which config keys changed."""

from __future__ import annotations

import json

import pytest

from posttrain.config import ConfigError, GRPOConfig, build_config
from posttrain.trainers.grpo import GRPOTrainer

TOY_REWARD = [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]


def _cfg(world: dict[str, str], out: str, **kw) -> GRPOConfig:
    base = {"model": world["model"], "train_data": world["data"], "out_dir": out,
            "rewards": TOY_REWARD, "group_size": 2, "prompts_per_step": 2,
            "max_new_tokens": 4, "max_steps": 2, "save_every": 1, "progress": False,
            "threads": 1, "report_to": []}
    return build_config(GRPOConfig, overrides={**base, **kw})


def test_second_fresh_run_is_refused_before_the_model_loads(toy_world, tmp_path):
    out = tmp_path / "run"
    GRPOTrainer(_cfg(toy_world, str(out))).train()
    with pytest.raises(ConfigError) as err:  # a missing model would fail later: refused first
        GRPOTrainer(_cfg(toy_world, str(out), model="/nonexistent"))
    message = str(err.value)
    assert "\n" not in message and "out_dir" in message and "metrics.jsonl" in message
    assert "overwrite: true" in message and "resume_from" in message


def test_overwrite_clears_the_earlier_run(toy_world, tmp_path):
    out = tmp_path / "run"
    GRPOTrainer(_cfg(toy_world, str(out), max_steps=3)).train()
    (out / "reward_errors.jsonl").write_text("{}\n")
    GRPOTrainer(_cfg(toy_world, str(out), overwrite=True)).train()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # not the earlier run's 1, 2, 3 followed by 1, 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-00000001", "step-00000002"]
    assert not (out / "reward_errors.jsonl").exists()


def test_resume_reports_step_and_changed_keys(toy_world, tmp_path, capsys):
    out = tmp_path / "run"
    GRPOTrainer(_cfg(toy_world, str(out))).train()
    capsys.readouterr()
    GRPOTrainer(_cfg(toy_world, str(out), max_steps=3, temperature=0.5,
                     resume_from="latest")).train()
    err = capsys.readouterr().err
    assert "resumed from step 2" in err
    assert "max_steps: 2 -> 3" in err and "temperature: 1.0 -> 0.5" in err
    assert "resume_from" not in err.split("changed")[-1]
