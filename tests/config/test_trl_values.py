"""A TRL user's habits (issue 48): `log_completions` values (item 4), KTO's weight advice and
pairs given to KTO (item 13), torch threads on a busy machine (item 15)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from posttrain.config import ConfigError, GRPOConfig, build_config
from posttrain.core import runtime
from posttrain.data import DataError
from posttrain.data.loading import validate_rows
from posttrain.trainers.kto import weight_note

BASE = {"model": "m", "train_data": "d"}


# ---- item 4: log_completions -------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, -8])
def test_a_negative_log_completions_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=rf"config key 'log_completions'={value}: expected true"):
        build_config(GRPOConfig, overrides={**BASE, "log_completions": value})
    with pytest.raises(ConfigError, match="'log_completions'"):
        GRPOConfig(log_completions=value)


@pytest.mark.parametrize("value", [True, False, 0, 3])
def test_log_completions_takes_true_false_and_counts(value):
    assert build_config(GRPOConfig, overrides={**BASE, "log_completions": value}
                        ).log_completions == value


# ---- item 13: KTO with unbalanced rows; preference pairs given to KTO ----------------------------
def test_kto_weight_advice_follows_the_papers_rule():
    # 16 desirable vs 2 undesirable, weights 1: 1 * 16 / (1 * 2) = 8, outside [1, 4/3];
    # desirable_weight in [1 * 2 / 16, 4/3 * 2 / 16] = [0.125, 0.167]
    note = weight_note(16, 2, 1.0, 1.0)
    assert note is not None and "= 8," in note and "desirable_weight in [0.125, 0.167]" in note
    assert weight_note(16, 2, 0.15, 1.0) is None  # 0.15 * 16 / 2 = 1.2: inside
    assert weight_note(10, 10, 1.0, 1.0) is None  # balanced
    assert weight_note(16, 0, 1.0, 1.0) is None  # one kind only: no ratio to advise on
    assert "[1.5, 2]" in weight_note(2, 3, 1.0, 1.0)  # 2 / 3 < 1: raise it to 3/2 .. 2


def test_kto_warns_at_start_on_unbalanced_rows(tmp_path, capsys):
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.arithmetic import write_jsonl
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer
    from posttrain.trainers.kto import KTOTrainer

    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                                     intermediate_size=32, seed=0), tok, tmp_path / "m")
    rows = [{"prompt": f"{i}+1", "completion": str(i + 1), "label": i < 16} for i in range(18)]
    KTOTrainer(model=str(tmp_path / "m"), train_data=str(write_jsonl(rows, tmp_path / "u.jsonl")),
               out_dir=str(tmp_path / "o"), progress=False, report_to=[], threads=1,
               max_steps=1, batch_size=4, rewards=[])
    err = [line for line in capsys.readouterr().err.splitlines() if "[kto] warning" in line]
    assert len(err) == 1 and "16 desirable vs 2 undesirable" in err[0]
    assert "desirable_weight in [0.125, 0.167]" in err[0]


def test_preference_pairs_given_to_kto_are_named_as_pairs():
    rows = [(n, {"prompt": f"1+{n}", "chosen": "2", "rejected": "3"}) for n in (1, 2, 3)]
    with pytest.raises(DataError) as err:
        validate_rows(rows, "unpaired", "pairs.jsonl")
    message = str(err.value)
    assert "these are preference pairs (chosen / rejected), not KTO's unpaired rows: use " \
           "`posttrain dpo`, or unpair them" in message
    assert "columns={" not in message and "(missing from 3 rows)" in message
    assert len(message.splitlines()) == 1  # once, not once per row or per field


# ---- item 15: threads on a busy machine ---------------------------------------------------------
@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_auto_threads_take_the_free_cores_and_say_so(monkeypatch, capsys, threads_kept):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runtime, "_DEFAULT_THREADS", 2)
    monkeypatch.setattr(runtime, "busy_cores", lambda: 1.6)  # another job on most of 2 cores
    runtime.setup_threads(0)
    assert torch.get_num_threads() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the machine is busy (1.6 of 2 cores" in err[0]
    monkeypatch.setattr(runtime, "busy_cores", lambda: 0.1)  # idle: torch's default, silent
    runtime.setup_threads(0)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
    monkeypatch.setattr(runtime, "busy_cores", lambda: 1.0)  # a fixed count: kept, warned
    runtime.setup_threads(2)
    assert torch.get_num_threads() == 2
    assert "warning: threads: 2 on a busy machine (1.0 of 2" in capsys.readouterr().err


def test_omp_num_threads_is_the_users_choice(monkeypatch, capsys, threads_kept):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(runtime, "busy_cores", lambda: pytest.fail("probed"))
    runtime.setup_threads(0)
    assert capsys.readouterr().err == ""


def test_busy_cores_sees_a_busy_process():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runtime.busy_cores(0.05)  # let it start
        assert runtime.busy_cores(0.5) >= 0.6  # one core spinning (plus whatever else runs)
    finally:
        spinner.kill()
        spinner.wait()
