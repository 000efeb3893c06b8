"""benchmarks/claims.py: the table arithmetic (hand-computed) and the KL estimator comparison."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _claims():
    spec = importlib.util.spec_from_file_location("claims", ROOT / "benchmarks" / "claims.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("claims", module)
    spec.loader.exec_module(module)
    return module


def test_mean_std_by_hand():
    claims = _claims()
    # mean (0.5 + 0.7 + 0.9) / 3 = 0.7; squares 0.04 + 0 + 0.04 = 0.08; / (3 - 1) = 0.04; sqrt 0.2
    mean, std = claims.mean_std([0.5, 0.7, 0.9])
    assert mean == pytest.approx(0.7) and std == pytest.approx(0.2)
    # (1 + 2 + 4) / 3 = 7/3; squares (4/3)^2 + (1/3)^2 + (5/3)^2 = 42/9; / 2 = 7/3; sqrt 1.5275
    assert claims.mean_std([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, math.sqrt(7 / 3)))
    assert claims.mean_std([3.0]) == (3.0, 0.0)


def test_table_rows_and_markdown():
    claims = _claims()
    per_seed = {
        "demo": {0: {"before": 0.5, "after": 0.9, "seconds": 10.0},
                 1: {"before": 0.5, "after": 0.7, "seconds": 20.0},
                 2: {"before": 0.5, "after": 0.8, "seconds": 30.5}},
        "ppo": {},  # not run: no row
    }
    specs = [
        {"job": "demo", "claim": "c", "metric": "after %", "key": "after", "scale": 100,
         "command": "cmd demo"},
        {"job": "demo", "claim": "c", "metric": "gain", "command": "cmd demo",
         "key": lambda r: r["after"] - r["before"]},
        {"job": "ppo", "claim": "p", "metric": "after", "key": "after", "command": "cmd ppo"},
    ]
    rows = claims.table_rows(per_seed, specs)
    assert [r["metric"] for r in rows] == ["after %", "gain"]
    after, gain = rows
    assert after["values"] == {0: 0.9, 1: 0.7, 2: 0.8}
    # mean 0.8; squares 0.01 + 0.01 + 0 = 0.02; / 2 = 0.01; std 0.1 (the same for the gains)
    assert after["mean"] == pytest.approx(0.8) and after["std"] == pytest.approx(0.1)
    assert gain["values"] == pytest.approx({0: 0.4, 1: 0.2, 2: 0.3})
    assert gain["mean"] == pytest.approx(0.3) and gain["std"] == pytest.approx(0.1)
    assert after["seconds"] == 60.5  # 10 + 20 + 30.5, the job's runs over the seeds
    text = claims.markdown(rows, [0, 1, 2, 3])
    line = text.splitlines()[2]
    assert line == "| c | after % | **80.0** | 10.0 | 90.0 | 70.0 | 80.0 |  | 60.5 | `cmd demo` |"
    assert text.splitlines()[3].startswith("| c | gain | **0.3** | 0.1 | 0.4 | 0.2 | 0.3 |")


def test_kl_estimators_zero_for_identical_models_and_aligned_with_sampler(tmp_path):
    """Policy == reference: exact KL, k1 and k3 are 0 at every token; the recomputed log-probs
    of the sampled tokens equal the sampler's (the positions are aligned)."""
    claims = _claims()
    from posttrain.models.loading import save_checkpoint
    from posttrain.tasks.arithmetic import prompt_rows, write_jsonl
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    for name, seed in (("a", 0), ("b", 1)):
        save_checkpoint(build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                                         intermediate_size=64, seed=seed), tok, tmp_path / name)
    write_jsonl(prompt_rows(6, 0), tmp_path / "prompts.jsonl")
    same = claims.kl_estimators(str(tmp_path / "a"), {"sft": str(tmp_path / "a"),
                                                      "data": str(tmp_path)}, 3, 0)
    assert same["kl_tokens"] > 0
    for key in ("kl_exact", "k1_mean", "k3_mean", "k1_var", "k3_var"):
        assert same[key] == pytest.approx(0.0, abs=1e-9), key
    assert same["sampler_gap_max"] < 1e-4
    other = claims.kl_estimators(str(tmp_path / "a"), {"sft": str(tmp_path / "b"),
                                                       "data": str(tmp_path)}, 3, 0)
    assert other["kl_exact"] > 0 and other["k3_mean"] > 0 and other["k1_var"] > 0
    assert other["sampler_gap_max"] < 1e-4
    json.dumps(other)  # cached as JSON
