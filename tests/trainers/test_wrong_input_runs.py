"""A TRL or verl user's second hour (issue 37): real runs on the toy world.

Each test is one habit that used to train silently on the wrong thing or crash; the config and
command-line cases are in tests/config/test_key_checks.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain
from posttrain.config import ConfigError
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.sft import SFTTrainer

ROOT = str(Path(posttrain.__file__).resolve().parents[1])


def _grpo(world: dict[str, str], out, **kw) -> GRPOTrainer:
    keys = {"model": world["model"], "train_data": world["data"], "out_dir": str(out),
            "group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4, "max_steps": 1,
            "progress": False, "threads": 1, "report_to": [],
            "rewards": ["tests.trainers.toy_rewards:sevens"], **kw}
    return GRPOTrainer(**keys)


def _steps(out) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


# ---- items 1 and 2: None and NaN rewards -----------------------------------------------------
def never_applies(completion: str) -> float | None:
    return None


def test_a_reward_that_scores_no_sample_keeps_the_groups_and_says_so(toy_world, tmp_path,
                                                                     capsys):
    summary = _grpo(toy_world, tmp_path / "run", rewards=[never_applies]).train()
    (last,) = summary["history"]
    assert last["reward/unscored"] == 4.0 and last["reward/dropped_groups"] == 0.0
    assert last["reward/errors/never_applies"] == 0.0  # None is not an error
    err = capsys.readouterr().err
    assert "4 of 4 samples were scored by no reward function" in err


def test_none_from_one_function_sums_the_others(toy_world, tmp_path):
    summary = _grpo(toy_world, tmp_path / "run", rewards=[never_applies, "format"]).train()
    (last,) = summary["history"]
    assert last["reward/unscored"] == 0.0 and last["reward/dropped_groups"] == 0.0


def nan_on_first(completion: str, prompt: str) -> float:
    return float("nan") if prompt == "a" else 1.0


def test_a_nan_reward_is_a_reported_error_not_a_dropped_group(toy_world, tmp_path, capsys):
    rows = [{"prompt": p, "answer": "7"} for p in "ab"]
    out = tmp_path / "run"
    summary = _grpo(toy_world, out, train_data=rows, rewards=[nan_on_first]).train()
    (last,) = summary["history"]
    assert last["reward/errors/nan_on_first"] == 2.0 and last["reward/dropped_groups"] == 0.0
    assert "reward 'nan_on_first' failed on 2 of 4 samples" in capsys.readouterr().err
    records = [json.loads(x) for x in (out / "reward_errors.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all("nan" in r["error"] for r in records)


# ---- item 3: truncation ---------------------------------------------------------------------
def test_most_completions_truncated_warns_and_shows_on_the_console_line(toy_world, tmp_path,
                                                                        capsys):
    _grpo(toy_world, tmp_path / "run", max_new_tokens=2, progress=True).train()
    err = capsys.readouterr().err
    assert "of the completions hit max_new_tokens=2" in err
    assert "response/truncated_frac=" in err  # the console line (stderr is not a terminal)


# ---- item 4: warm-up longer than the run -----------------------------------------------------
def test_sft_warmup_longer_than_the_run_warns(toy_world, tmp_path, capsys):
    rows = [{"prompt": "a", "completion": "7"}] * 4
    SFTTrainer(model=toy_world["model"], train_data=rows, out_dir=str(tmp_path), max_steps=5,
               batch_size=2, rewards=[], progress=False, threads=1, report_to=[])
    err = capsys.readouterr().err
    assert "'warmup_steps'=100 >= the run's 5 optimizer steps" in err


# ---- item 5: resume_from latest with nothing to resume ---------------------------------------
def test_resume_latest_without_a_checkpoint_starts_a_fresh_log(toy_world, tmp_path, capsys):
    out = tmp_path / "run"
    _grpo(toy_world, out, max_steps=2).train()  # no save_every: no checkpoint
    capsys.readouterr()
    _grpo(toy_world, out, max_steps=1, resume_from="latest").train()
    assert "nothing to resume" in capsys.readouterr().err
    assert _steps(out) == [1]  # a fresh log, not the earlier run's 1 2 followed by 1


# ---- item 9: log_completions ------------------------------------------------------------------
def test_log_completions_writes_samples_with_rewards(toy_world, tmp_path, capsys):
    out = tmp_path / "run"
    _grpo(toy_world, out, max_steps=2, log_completions=3).train()
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert set(rows[0]) >= {"prompt", "completion", "reward", "rewards", "truncated"}
    assert list(rows[0]["rewards"]) == ["tests.trainers.toy_rewards:sevens"]
    assert capsys.readouterr().err.count("sample 1/3") == 2


# ---- item 10: LoRA targets -------------------------------------------------------------------
def test_lora_targets_are_checked_before_the_weights_load(toy_world, tmp_path, monkeypatch):
    from posttrain.models import loading

    def no_load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ConfigError, match=r"\['query_key_value'\] match no module"):
        _grpo(toy_world, tmp_path / "run", lora_r=2, lora_target_modules=["query_key_value"])


def test_lora_all_linear_trains(toy_world, tmp_path):
    trainer = _grpo(toy_world, tmp_path / "run", lora_r=2, lora_target_modules="all-linear",
                    kl_coef=0.0)
    assert any("mlp" in n and "lora" in n for n, p in trainer.model.named_parameters()
               if p.requires_grad)
    assert trainer.train()["steps"] == 1


# ---- item 11: train() twice --------------------------------------------------------------------
def test_train_twice_is_refused_in_one_line(toy_world, tmp_path):
    trainer = _grpo(toy_world, tmp_path / "run")
    trainer.train()
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    assert "already called" in str(err.value) and "\n" not in str(err.value)


# ---- item 12: trackers before the model; a stopped run is unmissable ---------------------------
@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_a_missing_tracker_is_refused_before_the_model_loads(toy_world, tmp_path):
    with pytest.raises(ConfigError, match="wandb is not installed"):
        _grpo(toy_world, tmp_path / "run", model="/nonexistent/model/dir", report_to=["wandb"])


def test_a_run_stopped_by_sigterm_says_there_is_no_final(toy_world, tmp_path, capsys):
    trainer = _grpo(toy_world, tmp_path / "run", max_steps=3)
    step = trainer.step

    def step_then_term(n: int) -> dict:
        out = step(n)
        os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.step = step_then_term
    summary = trainer.train()
    assert summary["stopped_at_step"] == 1
    assert f"there is NO {tmp_path / 'run'}/final" in capsys.readouterr().err


# ---- item 13: the out_dir lock is released when the run ends -----------------------------------
def test_the_out_dir_lock_is_released_when_train_returns(toy_world, tmp_path):
    out = tmp_path / "run"
    _grpo(toy_world, out).train()
    probe = ("import sys; from posttrain.core.lock import OutDirLock; "
             "OutDirLock.acquire(sys.argv[1]); print('ok')")
    done = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.stdout.strip() == "ok", done.stderr
