"""The Python API as a TRL user writes it (issue 24, item 4)."""

from __future__ import annotations

import pytest
import torch

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


def test_a_callers_peft_model_keeps_its_adapters_after_training(toy_world, tmp_path):
    """Issue 57 item 1: the final checkpoint is saved merged, but the caller's PeftModel is not
    merged in place: its own `save_pretrained` afterwards writes the trained adapter tensors,
    and `final/` holds the base weights with those adapters merged."""
    import copy

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, tok = load_model_and_tokenizer(toy_world["model"])
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
                                                                              "v_proj"]))
    rows = [{"prompt": c, "answer": "7"} for c in "abcdefgh"]
    GRPOTrainer(model=model, tokenizer=tok, train_data=rows, rewards=[sevens], group_size=4,
                prompts_per_step=4, max_new_tokens=8, lr=5e-2, max_steps=2, progress=False,
                threads=1, report_to="none", out_dir=str(tmp_path / "run")).train()
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert trained and any(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == len(trained) > 0
    for name, tensor in saved.items():  # peft drops the adapter name from the saved keys
        live = name.replace(".weight", ".default.weight")
        assert torch.equal(tensor, trained[live]), name
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").state_dict()
    assert set(final) == set(expected)
    assert all(torch.allclose(final[k], expected[k], atol=1e-6) for k in final)


def test_a_script_without_the_main_guard_is_told_to_add_it(toy_world, tmp_path):
    """Issue 57 item 6: with async_rollouts the sampler process re-imports the script (spawn);
    one that trains at import is stopped there, before it takes the out_dir, and the run ends
    with one line naming the guard (no "another run is writing", no SamplerDied)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train_unguarded.py"
    script.write_text(
        "from posttrain.trainers.grpo import GRPOTrainer\n\n\n"
        "def sevens(completion, **row):\n    return float('7' in completion)\n\n\n"
        f"GRPOTrainer(model={toy_world['model']!r}, train_data={toy_world['data']!r}, "
        "rewards=[sevens], group_size=2, prompts_per_step=2, max_new_tokens=4, max_steps=2, "
        "async_rollouts=True, max_staleness=1, progress=False, threads=1, report_to='none', "
        f"out_dir={str(tmp_path / 'run')!r}).train()\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(root), "PATH": "",
                                                         "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "if __name__ == \"__main__\":" in last and "trains when it is imported" in last
    assert "another run" not in out.stderr and "SamplerDied" not in out.stderr
    assert out.stderr.count("Traceback") == 1  # the learner's own; the sampler prints none


def test_a_datasetdict_and_a_dataframe_are_taken_as_rows(toy_world, tmp_path):
    """Issue 57: a DatasetDict gives its `train_split` (or its only split), a pandas DataFrame
    its records; a DatasetDict without that split and with several is one DataError line."""
    import datasets
    import pandas as pd

    from posttrain.data import DataError

    model, tok = load_model_and_tokenizer(toy_world["model"])
    rows = [{"prompt": c, "answer": "7"} for c in "abcd"]
    keys = {"model": model, "tokenizer": tok, "rewards": [sevens], "group_size": 2,
            "prompts_per_step": 2, "max_new_tokens": 4, "max_steps": 1, "progress": False,
            "threads": 1, "report_to": "none"}
    split = datasets.Dataset.from_list(rows)
    for i, data in enumerate([datasets.DatasetDict({"train": split, "test": split[:1]}),
                              datasets.DatasetDict({"only": split}), pd.DataFrame(rows)]):
        trainer = GRPOTrainer(train_data=data, out_dir=str(tmp_path / str(i)), **keys)
        assert trainer.session.train_rows == rows
    two = datasets.DatasetDict({"a": split, "b": split})
    with pytest.raises(DataError) as err:
        GRPOTrainer(train_data=two, out_dir=str(tmp_path / "two"), **keys)
    assert "splits ['a', 'b']" in str(err.value) and "dataset['a']" in str(err.value)
    assert "\n" not in str(err.value)
