"""The code recipe's path: GRPO steps with code_reward in the sandbox, code/* counters, eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from posttrain.config import GRPOConfig, build_config
from posttrain.models.loading import save_checkpoint
from posttrain.sandbox.jail import STATUSES
from posttrain.tasks import functions as F
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.grpo import GRPOTrainer

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_code.yaml"


@pytest.fixture(scope="module")
def code_world(tmp_path_factory) -> dict[str, str]:
    """A random tiny Llama, 16 train code rows and 4 held-out rows (no SFT: it writes junk)."""
    root = tmp_path_factory.mktemp("grpo_code")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    return {"model": str(root / "model"),
            "train": str(F.write_jsonl(F.code_rows(16), root / "prompts.jsonl")),
            "heldout": str(F.write_jsonl(F.heldout_rows(4), root / "heldout.jsonl"))}


def _recipe_config(world: dict[str, str], out: Path, **overrides) -> GRPOConfig:
    """The shipped recipe with its paths pointed at the fixture and a tiny step budget."""
    small = {"model": world["model"], "train_data": world["train"],
             "eval_data": world["heldout"], "out_dir": str(out), "eval_size": 4,
             "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 12,
             "eval_max_new_tokens": 12, "max_steps": 2, "eval_every": 0, "progress": False}
    return build_config(GRPOConfig, RECIPE, overrides={**small, **overrides})


def test_recipe_uses_the_code_reward_and_loads():
    raw = yaml.safe_load(RECIPE.read_text())
    assert raw["trainer"] == "grpo"
    assert raw["rewards"][0]["name"] == "code"  # first reward = the accuracy in evaluation
    assert raw["eval_size"] >= 500
    cfg = build_config(GRPOConfig, RECIPE)
    assert cfg.threads == 1 and cfg.rewards == raw["rewards"]


def test_two_grpo_steps_with_the_sandbox_record_code_counters(code_world, tmp_path):
    summary = GRPOTrainer(_recipe_config(code_world, tmp_path)).train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        counts = {s: r[f"code/{s}"] for s in STATUSES}
        # every one of the 2 prompts x 2 samples was run in the sandbox exactly once
        assert sum(counts.values()) == 4, counts
        assert counts["sandbox_error"] == 0
        # a random 1-layer model writes junk: nothing passes, so the reward is 0
        assert counts["passed"] == 0 and r["reward/mean"] == 0.0
    # held-out evaluation ran on the code rows (tests not in the prompt) before and after
    for key in ("eval_before_detail", "eval_after_detail"):
        assert summary[key]["n"] == 4 and summary[key]["accuracy"] == 0.0
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_code_reward_scores_a_right_program_in_the_trainer_scorer(code_world, tmp_path):
    trainer = GRPOTrainer(_recipe_config(code_world, tmp_path))
    rows = F.code_rows(3)
    completions = [rows[0]["solution"], F.program(F.parse_prompt(rows[1]["prompt"]),
                                                  flawed=True), "while True: pass"]
    result = trainer.session.rewards.score(completions, rows)
    assert result.per_function["code"][0] == 1.0 and result.per_function["code"][2] == 0.0
    assert result.metrics["code/passed"] >= 1 and result.metrics["code/timeout"] == 1


@pytest.mark.slow
def test_code_world_quick_then_recipe_steps(tmp_path):
    """`python -m posttrain.tasks.code_world --quick` then two recipe steps on its SFT model."""
    from posttrain.tasks.code_world import main

    assert main(["--out", str(tmp_path / "world"), "--quick", "--threads", "1"]) == 0
    summary = json.loads((tmp_path / "world" / "summary.json").read_text())
    paths = summary["paths"]
    for key in ("sft", "prompts", "heldout", "sft_model"):
        assert Path(paths[key]).exists(), key
    for mode in ("sft_greedy", "sft_t1"):
        rates = summary[mode]
        assert 0.0 <= rates["pass_rate"] <= 1.0 and rates["n"] == 32
        assert sum(rates[f"code/{s}"] for s in STATUSES) == 32
    world = {"model": paths["sft_model"], "train": paths["prompts"], "heldout": paths["heldout"]}
    assert GRPOTrainer(_recipe_config(world, tmp_path / "grpo")).train()["steps"] == 2
