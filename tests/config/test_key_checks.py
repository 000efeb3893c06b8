"""A TRL or verl user's second hour (issue 37): config keys, hints and the command line.

The trainer runs of the same issue are in tests/trainers/test_wrong_input_runs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import posttrain
from posttrain.cli import main
from posttrain.config import (
    ConfigError,
    DPOConfig,
    GRPOConfig,
    PPOConfig,
    RMConfig,
    SearchConfig,
    SFTConfig,
    build_config,
)
from posttrain.config.preference import KTOConfig, OnlineDPOConfig
from posttrain.data.prompts import render_prompt
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer

BASE = {"model": "m", "train_data": "d"}


def _error(cls: type = GRPOConfig, recipe: str | None = None, **keys: object) -> str:
    with pytest.raises(ConfigError) as err:
        build_config(cls, recipe, overrides={**BASE, **keys})
    return str(err.value)


# ---- item 6: eval_every without eval_data ---------------------------------------------------
def test_eval_every_without_eval_data_is_refused():
    assert "config key 'eval_every'=5: no eval_data is set" in _error(eval_every=5)
    assert build_config(GRPOConfig, overrides={**BASE, "eval_every": 5,
                                               "eval_data": "e"}).eval_every == 5


# ---- item 7: a prompt already rendered with the chat template --------------------------------
def test_an_already_rendered_prompt_is_not_wrapped_again(capsys, monkeypatch):
    from posttrain.data import prompts

    monkeypatch.setattr(prompts, "_reported", [False])  # said once a process: earlier tests too
    tok = build_char_tokenizer()
    once = render_prompt(tok, "12+3")
    assert once.startswith(tok.bos_token)
    assert render_prompt(tok, once) == once  # not "<s><s>12+3\n\n"
    assert "used as they are, not wrapped again" in capsys.readouterr().err


def test_a_template_opening_is_kept_per_tokenizer_object_and_dropped_with_it():
    """Keyed by the object, not id(): a tokenizer made after another was freed can reuse its id."""
    import gc

    from posttrain.data import prompts

    gc.collect()  # earlier tests' tokenizers go first
    tok = build_char_tokenizer()
    render_prompt(tok, "1+1")
    before = len(prompts._openings)
    assert tok in prompts._openings
    del tok
    gc.collect()
    assert len(prompts._openings) == before - 1


# ---- item 8: names shared with TRL and verl ---------------------------------------------------
@pytest.mark.parametrize(("key", "ours"), [
    ("max_response_length", "max_new_tokens"),
    ("data.max_response_length", "max_new_tokens"),
    ("data.train_batch_size", "prompts_per_step"),
    ("actor_rollout_ref.rollout.n", "group_size"),
    ("max_prompt_length", "max_prompt_len"),
])
def test_verl_and_trl_names_hint_the_key_with_the_same_meaning(key, ours):
    message = _error(**{key: 8})
    assert f"unknown config key '{key}'. Did you mean {ours}?" in message


def test_a_nested_verl_section_is_hinted_key_by_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  train_batch_size: 8\n  max_response_length: 512\n")
    message = _error(recipe=str(recipe))
    assert "'data.train_batch_size'. Did you mean prompts_per_step?" in message
    assert "'data.max_response_length'. Did you mean max_new_tokens?" in message


def test_a_shared_name_is_explained_the_first_time(capsys, monkeypatch):
    from posttrain.config import hints as hints_mod

    monkeypatch.setattr(hints_mod, "_noted", set())
    build_config(GRPOConfig, overrides={**BASE, "generation_batch_size": 16})
    build_config(GRPOConfig, overrides={**BASE, "generation_batch_size": 16})
    err = capsys.readouterr().err
    assert err.count("generation_batch_size is posttrain's") == 1
    assert "prompts_per_step * group_size" in err


# ---- issue 60 item 2: keys renamed to one word per thing; the old names keep working -----------
@pytest.mark.parametrize("cls, old, new", [(SFTConfig, "max_new_tokens", "eval_max_new_tokens"),
                                           (DPOConfig, "max_new_tokens", "eval_max_new_tokens"),
                                           (KTOConfig, "max_new_tokens", "eval_max_new_tokens"),
                                           (DPOConfig, "gamma", "simpo_gamma"),
                                           (OnlineDPOConfig, "gamma", "simpo_gamma"),
                                           (SFTConfig, "rewards", "eval_rewards"),
                                           (KTOConfig, "rewards", "eval_rewards"),
                                           (SearchConfig, "batch_size", "generation_batch_size")])
def test_a_renamed_key_is_read_under_its_new_name_in_one_line(capsys, cls, old, new):
    value = [] if old == "rewards" else 7
    more = {"eval_data": "e", "methods": ["majority"]} if cls is SearchConfig else {}
    cfg = build_config(cls, overrides={**BASE, **more, old: value})
    assert getattr(cfg, new) == value and not hasattr(cfg, old)
    err = [x for x in capsys.readouterr().err.splitlines() if "is now" in x]
    assert len(err) == 1 and f"config key '{old}' is now '{new}'" in err[0], err


def test_a_key_of_the_same_name_keeps_its_meaning_where_it_is_one(capsys):
    """GRPO's `max_new_tokens` is its sampling budget, PPO's `gamma` its discount: not renamed;
    a reward model has neither budget, so the old name is still an unknown key there."""
    assert build_config(GRPOConfig, overrides={**BASE, "max_new_tokens": 7}).max_new_tokens == 7
    assert build_config(PPOConfig, overrides={**BASE, "gamma": 0.5}).gamma == 0.5
    assert "is now" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown config key 'max_new_tokens'"):
        build_config(RMConfig, overrides={**BASE, "max_new_tokens": 7})
    # search's `batch_size` is now generation_batch_size; GRPO has that key, but a GRPO
    # user's `batch_size` means rows per step (TRL's per_device_train_batch_size): not renamed
    with pytest.raises(ConfigError, match="unknown config key 'batch_size'"):
        build_config(GRPOConfig, overrides={**BASE, "batch_size": 7})
    assert "is now" not in capsys.readouterr().err


def test_dpo_and_kto_each_refuse_the_others_loss_in_one_line():
    """`loss_type` is declared once (TRL's name in both); each trainer takes its own losses."""
    with pytest.raises(ConfigError, match=r"'loss_type'='kto': expected one of \['sigmoid'"):
        build_config(DPOConfig, overrides={**BASE, "loss_type": "kto"})
    with pytest.raises(ConfigError, match=r"'loss_type'='ipo': expected one of \['kto'"):
        build_config(KTOConfig, overrides={**BASE, "loss_type": "ipo"})
    assert build_config(KTOConfig, overrides=BASE).loss_type == "kto"
    assert build_config(OnlineDPOConfig, overrides=BASE).loss_type == "sigmoid"

# ---- item 10: lora_target_modules all-linear, names checked -----------------------------------
def test_all_linear_is_accepted_as_a_string_and_reaches_peft():
    from posttrain.models.lora import apply_lora, check_lora_targets

    cfg = build_config(GRPOConfig, overrides={**BASE, "lora_target_modules": "all-linear"})
    assert cfg.lora_target_modules == ["all-linear"]
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, seed=0)
    check_lora_targets(model, cfg.lora_target_modules)
    peft_model = apply_lora(model, r=2, target_modules=cfg.lora_target_modules)
    names = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("gate_proj" in n for n in names) and any("o_proj" in n for n in names)


def test_unknown_lora_targets_are_named_with_the_model_linear_layers():
    from posttrain.models.lora import check_lora_targets

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, seed=0)
    with pytest.raises(ValueError) as err:
        check_lora_targets(model, ["q_proj", "query_key_value"])
    assert "['query_key_value'] match no module" in str(err.value)
    assert "q_proj" in str(err.value) and "all-linear" in str(err.value)


# ---- item 12: every wrong key at once; argparse habits; paths; accelerate --------------------
def test_every_unknown_or_wrong_key_is_reported_at_once(tmp_path):
    recipe = tmp_path / "trl.yaml"
    recipe.write_text(textwrap.dedent("""\
        learning_rate: 1.0e-5
        num_generations: 8
        max_completion_length: 256
        group_size: one
        logging_steps: 5
    """))
    message = _error(recipe=str(recipe), lr="fast")
    assert message.startswith("6 config keys are wrong:")
    for part in ("'learning_rate'. Did you mean lr?", "'num_generations'. Did you mean group_size",
                 "Did you mean max_new_tokens?", "group_size='one': expected an integer",
                 "'logging_steps'. Did you mean log_every?", "lr='fast': expected a number"):
        assert part in message
    assert message.count("Valid keys:") == 1


def test_argparse_style_options_name_the_key_value_form(capsys):
    assert main(["grpo", "--max_steps", "10", "--lr=1e-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "given as key=value" in err and "max_steps=10 lr=1e-5" in err


def test_accelerate_launch_is_told_to_use_torchrun(capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    main(["grpo", "--max_steps", "1"])
    err = capsys.readouterr().err
    assert "accelerate launch" in err and "torchrun --nproc_per_node" in err


def test_a_missing_absolute_path_is_not_described_as_a_hub_lookup():
    from posttrain.models.loading import ModelLoadError, load_tokenizer

    with pytest.raises(ModelLoadError) as err:
        load_tokenizer("/nonexistent/run/sft/final")
    assert "does not exist" in str(err.value) and "was looked up" not in str(err.value)


def test_finished_raises_for_a_stopped_run():
    from posttrain.core.io import RunStopped, finished

    assert finished({"steps": 3})["steps"] == 3
    with pytest.raises(RunStopped, match="stopped by a signal at step 2"):
        finished({"stopped_at_step": 2, "steps": 2})


# ---- item 13: one run per out_dir ------------------------------------------------------------
ROOT = str(Path(posttrain.__file__).resolve().parents[1])
ENV = {**os.environ, "PYTHONPATH": ROOT}
_HOLD = ("import sys, time; from posttrain.core.lock import OutDirLock; "
         "OutDirLock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)")


def test_out_dir_lock_refuses_a_second_process_and_frees_on_exit(tmp_path):
    from posttrain.core.lock import OutDirBusy, OutDirLock

    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(OutDirBusy) as err:
            OutDirLock.acquire(tmp_path)
        assert f"pid {proc.pid}" in str(err.value)
    finally:
        proc.kill()
        proc.wait()
    lock = OutDirLock.acquire(tmp_path)  # a killed holder leaves a stale file: taken over
    lock.release()
    lock.release()  # idempotent


def test_a_second_run_into_a_locked_out_dir_is_one_config_line(tmp_path, capsys):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "run")],
                            stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert proc.stdout.readline().strip() == "held"
        code = main(["grpo", "model=/nonexistent/m/final", "train_data=/nonexistent/d.jsonl",
                     f"out_dir={tmp_path / 'run'}", "report_to=none", "progress=false",
                     "threads=1"])  # no note about a busy machine: one line, the lock's
    finally:
        proc.kill()
        proc.wait()
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another run is writing to" in err, err

