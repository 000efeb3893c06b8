"""The command line: help, config errors as exit code 2 with the key named, the demo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from posttrain.cli import main


def test_help_lists_commands_and_config_keys(capsys):
    assert main(["--help"]) == 0
    assert "grpo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["grpo", "--help"])
    out = capsys.readouterr().out
    assert "group_size" in out and "sampled per prompt" in out


def test_config_errors_exit_2_and_name_the_key(capsys, tmp_path):
    assert main(["grpo", "model=m", "train_data=d", "group_size=1"]) == 2
    assert "group_size" in capsys.readouterr().err
    assert main(["grpo", "model=m", "train_data=d", "lr_sched=cosine"]) == 2
    assert "unknown config key 'lr_sched'" in capsys.readouterr().err
    missing = tmp_path / "nope.jsonl"
    assert main(["grpo", "model=m", f"train_data={missing}", f"out_dir={tmp_path}"]) == 2
    assert str(missing) in capsys.readouterr().err
    assert main(["frobnicate"]) == 2


@pytest.mark.slow
def test_demo_quick_writes_summary_and_curves(tmp_path):
    """The demo's whole path (world, SFT, GRPO, table, PNG, summary) in a short run."""
    out = tmp_path / "demo"
    subprocess.run([sys.executable, "-m", "posttrain.cli", "demo", "--quick", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_before", "eval_after", "seconds", "peak_rss_mb"):
        assert key in summary
    assert summary["heldout_n"] == 100
    dump = [json.loads(x) for x in (out / "grpo" / "eval_after.jsonl").read_text().splitlines()]
    # the summary's accuracy is the fraction of held-out samples the verifier marked correct
    assert len(dump) == 100
    assert summary["eval_after"] == pytest.approx(sum(r["correct"] for r in dump) / 100)
    assert (out / "curves.png").stat().st_size > 1000
    assert (out / "grpo" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_demo_full_raises_heldout_accuracy_by_10_points(tmp_path):
    """The main claim: GRPO with the verifier fixes the SFT model's sign flaw (fixed seed).
    Takes several minutes on 2 CPU cores."""
    out = tmp_path / "demo"
    subprocess.run([sys.executable, "-m", "posttrain.cli", "demo", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_n"] == 1000
    assert summary["eval_after"] - summary["eval_before"] >= 0.10, summary
