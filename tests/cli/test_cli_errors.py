"""The command line's one-line errors (issue 24, items 9 and 11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from posttrain.cli import main
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FAST = ["group_size=2", "prompts_per_step=2", "max_new_tokens=4", "max_steps=1",
        "progress=false", "report_to=none", "threads=1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli_errors")
    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                                     intermediate_size=32, seed=0), tok, root / "model")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": c, "answer": "7"}) + "\n" for c in "abcd"))
    return {"model": str(root / "model"), "data": str(data)}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_missing_model_path_is_one_line(tiny, tmp_path, capsys):
    code = main(["grpo", "model=/nonexistent/run/final", f"train_data={tiny['data']}",
                 f"out_dir={tmp_path}", *FAST])
    assert code == 2
    err = _one_line_error(capsys)
    assert err.startswith("posttrain grpo: model error:") and "/nonexistent/run/final" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_config_error(tiny, tmp_path, capsys):
    code = main(["grpo", f"model={tiny['model']}", f"train_data={tiny['data']}",
                 f"out_dir={tmp_path}", "device=cuda", *FAST])
    assert code == 2
    err = _one_line_error(capsys)
    assert "config key 'device'='cuda': no CUDA device is available" in err


def test_a_bad_device_name_is_a_config_error(tiny, tmp_path, capsys):
    assert main(["grpo", f"model={tiny['model']}", f"train_data={tiny['data']}",
                 f"out_dir={tmp_path}", "device=gpu0", *FAST]) == 2
    assert "config key 'device'='gpu0'" in _one_line_error(capsys)


def test_a_failing_reward_is_one_line_with_the_sample(tiny, tmp_path, capsys, monkeypatch):
    (tmp_path / "failing_rewards.py").write_text(textwrap.dedent('''
        def fails(completion):
            raise ValueError("no luck")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["grpo", f"model={tiny['model']}", f"train_data={tiny['data']}",
                 f"out_dir={tmp_path / 'out'}", "rewards=[{name: 'failing_rewards:fails'}]",
                 "reward_on_error=raise", *FAST])
    assert code == 1
    err = _one_line_error(capsys)
    assert err.startswith("posttrain grpo: reward error: reward function "
                          "'failing_rewards:fails' failed on sample 0: ValueError('no luck')")
    assert "; completion: '" in err
    sys.modules.pop("failing_rewards", None)


def test_installed_script_imports_rewards_from_the_working_directory(tmp_path):
    """The console script does not put the working directory on sys.path (python -m does):
    simulate it by dropping that entry, then name a reward module that lives there."""
    (tmp_path / "myrewards.py").write_text("def f(completion):\n    return 1.0\n")
    script = ("import sys; sys.path.pop(0); from posttrain.cli import main; "
              "sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", script, "grpo", "model=m", "train_data=missing.jsonl",
         'rewards=[{name: "myrewards:f"}]'], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120)
    assert "cannot import module 'myrewards'" not in out.stderr
    assert "missing.jsonl: file not found" in out.stderr and out.returncode == 2
