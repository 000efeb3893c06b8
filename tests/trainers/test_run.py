"""`posttrain sft` / `posttrain eval` entry points: summary.json, length check, eval command."""

from __future__ import annotations

import json

import pytest

from posttrain.config import ConfigError, GRPOConfig, SFTConfig, build_config
from posttrain.engine.eval_command import run_eval
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.arithmetic import heldout_rows, sft_rows, write_jsonl
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.sft import SFTTrainer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                                     intermediate_size=64, seed=0), tok, root / "model")
    write_jsonl(sft_rows(256, 0), root / "sft.jsonl")
    write_jsonl(heldout_rows(16), root / "heldout.jsonl")
    return root


def test_sft_run_writes_summary_and_lowers_loss(world, tmp_path):
    cfg = build_config(SFTConfig, overrides={
        "model": str(world / "model"), "train_data": str(world / "sft.jsonl"),
        "eval_data": str(world / "heldout.jsonl"), "eval_size": 16, "out_dir": str(tmp_path),
        "max_steps": 20, "batch_size": 16, "lr": 3e-3, "progress": False, "threads": 1})
    summary = SFTTrainer(cfg).train()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["train"]["loss_last"] < saved["train"]["loss_first"]
    assert {"eval_before", "eval_after", "seconds", "peak_rss_mb"} <= set(saved)
    assert summary["eval_after_detail"]["n"] == 16
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_sft_rows_longer_than_max_len_are_an_error(world, tmp_path):
    cfg = build_config(SFTConfig, overrides={
        "model": str(world / "model"), "train_data": str(world / "sft.jsonl"),
        "out_dir": str(tmp_path), "max_seq_len": 20, "progress": False})
    with pytest.raises(ConfigError, match="max_seq_len"):
        SFTTrainer(cfg).train()


def test_eval_command(world, tmp_path):
    cfg = build_config(GRPOConfig, overrides={
        "model": str(world / "model"), "train_data": "__unused__",
        "eval_data": str(world / "heldout.jsonl"), "eval_size": 8, "out_dir": str(tmp_path),
        "eval_max_new_tokens": 8, "progress": False})
    result = run_eval(cfg)
    assert result["n"] == 8 and 0.0 <= result["accuracy"] <= 1.0
    assert json.loads((tmp_path / "summary.json").read_text())["eval_after"] == result["accuracy"]
