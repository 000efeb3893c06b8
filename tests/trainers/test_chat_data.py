"""Conversational data through the trainers, `chat_template`, `prompt_field`, prompt lengths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posttrain.config import ConfigError, GRPOConfig, build_config
from posttrain.data import DataError
from posttrain.models import load_model_and_tokenizer
from posttrain.trainers.dpo import DPOTrainer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.reward_model import RewardModelTrainer
from posttrain.trainers.sft import SFTTrainer

TOY_REWARD = [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]
U = {"role": "user", "content": "1+2"}
KEYS = {"max_steps": 1, "progress": False, "threads": 1, "report_to": [], "rewards": []}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _grpo(world: dict[str, str], out: Path, **kw) -> GRPOConfig:
    base = {"model": world["model"], "train_data": world["data"], "out_dir": str(out),
            "rewards": TOY_REWARD, "group_size": 2, "prompts_per_step": 2,
            "max_new_tokens": 8, "max_steps": 1, "progress": False, "threads": 1,
            "report_to": []}
    return build_config(GRPOConfig, overrides={**base, **kw})


def test_sft_on_messages_trains_on_the_last_assistant_turn(toy_world, tmp_path):
    rows = [{"messages": [{"role": "system", "content": "s"}, U, A("3"), A("4")]}] * 4
    trainer = SFTTrainer(model=toy_world["model"], train_data=_jsonl(tmp_path / "m.jsonl", rows),
                         out_dir=str(tmp_path / "out"), batch_size=2, **KEYS)
    tok = trainer.tokenizer
    ids, n_prompt = trainer.examples[0]
    # the template renders system/user with "\n", assistant turns with "</s>"
    assert tok.decode(ids[:n_prompt]) == "<s>s\n1+2\n3</s>"
    assert tok.decode(ids[n_prompt:]) == "4</s>"  # one EOS: the template closes the turn
    assert trainer.train()["steps"] == 1


def test_dpo_and_rm_on_ultrafeedback_shaped_pairs(toy_world, tmp_path):
    """chosen / rejected as whole conversations give the same tensors as the string form."""
    conv = [{"prompt": "1+2", "chosen": [U, A("3")], "rejected": [U, A("4")]}] * 4
    flat = [{"prompt": "1+2", "chosen": "3", "rejected": "4"}] * 4
    keys = {"model": toy_world["model"], "batch_size": 2, "micro_batch_size": 4, **KEYS}
    a = DPOTrainer(train_data=_jsonl(tmp_path / "c.jsonl", conv), out_dir=str(tmp_path / "a"),
                   **keys)
    b = DPOTrainer(train_data=_jsonl(tmp_path / "f.jsonl", flat), out_dir=str(tmp_path / "b"),
                   **keys)
    assert a.pairs.digest() == b.pairs.digest()
    keys.pop("rewards")
    rm = RewardModelTrainer(train_data=str(tmp_path / "c.jsonl"), out_dir=str(tmp_path / "r"),
                            **keys)
    rm_flat = RewardModelTrainer(train_data=str(tmp_path / "f.jsonl"),
                                 out_dir=str(tmp_path / "rf"), **keys)
    assert rm.train_set["chosen"] == rm_flat.train_set["chosen"]


def test_grpo_prompt_field(toy_world, tmp_path):
    rows = [{"question": c, "answer": "7"} for c in "abcd"]
    data = _jsonl(tmp_path / "q.jsonl", rows)
    trainer = GRPOTrainer(_grpo(toy_world, tmp_path / "out", train_data=data,
                                prompt_field="question"))
    rollout, _ = trainer.rollout_step()
    assert rollout.num_sequences == 4
    with pytest.raises(DataError) as err:  # without it: one line that names the fix
        GRPOTrainer(_grpo(toy_world, tmp_path / "o2", train_data=data))
    assert "\n" not in str(err.value) and "columns={prompt: question}" in str(err.value)


def _no_template_model(toy_world: dict[str, str], root: Path) -> str:
    """The toy model saved with a tokenizer that has no chat template (a base model)."""
    model, tok = load_model_and_tokenizer(toy_world["model"])
    tok.chat_template = None
    model.save_pretrained(root)
    tok.save_pretrained(root)
    (root / "chat_template.jinja").unlink(missing_ok=True)
    return str(root)


def test_conversational_prompt_needs_a_template(toy_world, tmp_path):
    data = _jsonl(tmp_path / "c.jsonl", [{"prompt": [U], "answer": "7"}] * 4)
    with pytest.raises(DataError) as err:  # `none`: never flattened
        GRPOTrainer(_grpo(toy_world, tmp_path / "a", train_data=data, chat_template="none"))
    assert (err.value.line, err.value.field) == (1, "prompt") and "none" in str(err.value)
    base = _no_template_model(toy_world, tmp_path / "base")
    with pytest.raises(DataError, match="tokenizer has none"):
        GRPOTrainer(_grpo(toy_world, tmp_path / "b", train_data=data, model=base))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    trainer = GRPOTrainer(_grpo(toy_world, tmp_path / "c", train_data=data, model=base,
                                chat_template=template))
    assert trainer.session.render([U]) == "user: 1+2\n"
    trainer.train()
    saved = load_model_and_tokenizer(str(tmp_path / "c" / "final"))[1]
    assert saved.chat_template == template  # the trained model keeps its template


def test_prompt_lengths_are_checked_before_the_weights_load(toy_world, tmp_path):
    """The toy model has 64 positions; its weights file is removed, so only the tokenizer and
    the config can have been read when the error comes."""
    no_weights = tmp_path / "noweights"
    shutil.copytree(toy_world["model"], no_weights)
    (no_weights / "model.safetensors").unlink()
    rows = [{"prompt": "a", "answer": "7"}, {"prompt": "x" * 60, "answer": "7"}]
    data = _jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DataError) as err:
        GRPOTrainer(_grpo(toy_world, tmp_path / "a", train_data=data, model=str(no_weights)))
    assert (err.value.source, err.value.line, err.value.field) == (data, 2, "prompt")
    assert "context of 64" in str(err.value)
    with pytest.raises(DataError, match="max_prompt_len=10"):
        GRPOTrainer(_grpo(toy_world, tmp_path / "b", train_data=data, model=str(no_weights),
                          max_prompt_len=10))
    with pytest.raises(ConfigError, match="max_prompt_len"):
        GRPOTrainer(_grpo(toy_world, tmp_path / "c", model=str(no_weights), max_prompt_len=60))
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="max_new_tokens"):
            _grpo(toy_world, tmp_path / "d", max_new_tokens=bad)


def test_an_sft_prompt_longer_than_the_context_is_refused(toy_world, tmp_path):
    """max_seq_len (256) would let it through; the model has 64 positions."""
    rows = [{"prompt": "1+2", "completion": "3"}, {"prompt": "x" * 70, "completion": "3"}]
    data = _jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DataError) as err:
        SFTTrainer(model=toy_world["model"], train_data=data, out_dir=str(tmp_path / "o"),
                   **KEYS)
    assert (err.value.line, err.value.field) == (2, "prompt") and "context of 64" in str(err.value)
