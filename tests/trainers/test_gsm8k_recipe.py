"""The GSM8K recipe's loading path, offline: a local Qwen2-shaped model and a local dataset with
GSM8K's columns ({question, answer: "... #### 72"}) stand in for the Hub ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config import GRPOConfig, build_config
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.grpo import GRPOTrainer

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_gsm8k_qwen.yaml"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> dict[str, str]:
    datasets = pytest.importorskip("datasets")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("gsm8k")
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    save_checkpoint(Qwen2ForCausalLM(cfg), tok, root / "qwen")
    rows = [{"question": f"what is {a} plus {a}", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"}
            for a in range(12)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                               "test": datasets.Dataset.from_list(rows[:4])})
    dd.save_to_disk(str(root / "gsm8k"))
    return {"model": str(root / "qwen"), "data": str(root / "gsm8k"), "root": str(root)}


def test_gsm8k_recipe_runs_offline_with_stand_ins(stand_in, tmp_path):
    cfg = build_config(GRPOConfig, RECIPE, overrides={
        "model": stand_in["model"], "train_data": stand_in["data"],
        "eval_data": stand_in["data"], "data_subset": "", "out_dir": str(tmp_path),
        "max_steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8,
        "eval_max_new_tokens": 8, "eval_size": 4, "autocast_bf16": False, "progress": False,
        "save_every": 0, "eval_every": 0})
    trainer = GRPOTrainer(cfg)
    row = trainer.session.train_rows[0]
    # columns {prompt: question} and the "####" marker turn GSM8K rows into prompt/answer rows
    assert row["prompt"] == "what is 0 plus 0" and row["answer"] == "0"
    rendered = trainer.session.render(row["prompt"])
    assert 0 <= rendered.index("Think step by step") < rendered.index("what is 0 plus 0")
    summary = trainer.train()
    assert summary["eval_before_detail"]["n"] == 4
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1
