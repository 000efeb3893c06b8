"""``posttrain search``: config errors before any model loads; an end-to-end run on tiny models
that reports accuracy and generated tokens for every method."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.models.loading import save_checkpoint
from posttrain.models.reward import build_reward_model
from posttrain.tasks.arithmetic import heldout_rows, write_jsonl
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    tok = build_char_tokenizer()
    lm = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                          seed=0)
    save_checkpoint(lm, tok, root / "policy")
    torch.manual_seed(0)
    save_checkpoint(build_reward_model(lm, "orm", tok, num_labels=1), tok, root / "orm")
    prm = build_reward_model(lm, "prm", tok, num_labels=2)
    prm.config.posttrain_prm = {"separator": "; ", "split": "think", "num_classes": 2}
    save_checkpoint(prm, tok, root / "prm")
    write_jsonl(heldout_rows(3), root / "heldout.jsonl")
    return root


def test_search_config_errors_name_the_key_before_loading(world, capsys):
    base = ["search", "model=does/not/exist", f"eval_data={world / 'heldout.jsonl'}"]
    assert main([*base, "methods=[beam]", f"orm={world / 'orm'}"]) == 2
    assert "set 'prm'" in capsys.readouterr().err
    assert main([*base, f"orm={world / 'prm'}", f"prm={world / 'prm'}"]) == 2
    err = capsys.readouterr().err
    assert "'orm'" in err and "ForSequenceClassification" in err
    assert main([*base, "n=[4, 3]", f"prm={world / 'prm'}"]) == 2
    assert "'n'" in capsys.readouterr().err
    assert main([*base, "methods=[greedy]"]) == 2
    assert "'methods'" in capsys.readouterr().err
    assert main(["search", "model=m", f"eval_data={world / 'missing.jsonl'}",
                 "methods=[majority]"]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_search_end_to_end_reports_accuracy_and_tokens(world, capsys):
    out = world / "out"
    assert main(["search", f"model={world / 'policy'}", f"eval_data={world / 'heldout.jsonl'}",
                 f"orm={world / 'orm'}", f"prm={world / 'prm'}", "n=[1, 2, 4]",
                 "beam_width=2", "expansions=2", "beam_max_steps=3", "max_new_tokens=12",
                 f"out_dir={out}", "threads=1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    methods = summary["methods"]
    assert set(methods) == {"majority", "pass@n", "best_of_n:orm", "best_of_n:prm",
                            "weighted:prm", "beam"}
    for name, by_n in methods.items():
        if name == "beam":
            assert 0.0 <= by_n["accuracy"] <= 1.0 and by_n["tokens"] > 0
            continue
        assert set(by_n) == {"1", "2", "4"}
        assert all(0.0 <= v["accuracy"] <= 1.0 for v in by_n.values())
        # tokens grow with n: n solutions per trial, each 1..12 tokens
        assert 1 <= by_n["1"]["tokens"] <= 12
        assert by_n["4"]["tokens"] == pytest.approx(4 * by_n["1"]["tokens"])
    assert summary["problems"] == 3
    assert "methods" in capsys.readouterr().out


def test_shipped_search_recipe_loads(world):
    from pathlib import Path

    from posttrain.config import SearchConfig, build_config

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "search_arith.yaml"
    cfg = build_config(SearchConfig, recipe, {"orm": str(world / "orm"),
                                              "prm": str(world / "prm")})
    assert cfg.methods == ["best_of_n", "majority", "weighted", "beam"]
    assert (cfg.n, cfg.beam_width * cfg.expansions) == ([1, 4, 16], 16)
