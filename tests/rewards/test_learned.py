import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.models.loading import save_checkpoint
from posttrain.models.reward import PRM_META_KEY, build_reward_model
from posttrain.models.reward_models import ProcessRewardModel, aggregate_scores, get_reward_model
from posttrain.rewards.registry import Rewards, RewardSpec, validate_specs
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer

PROMPT = "12+7*3"
GOOD = "<think>12+7=19; 19*3=57</think><answer>57</answer>"
BAD = "<think>12+7=18; 18*3=54</think><answer>54</answer>"


@pytest.fixture(scope="module")
def scorers(tmp_path_factory) -> dict[str, str]:
    """An untrained ORM and PRM (random heads) and the causal LM they come from, on disk."""
    root = tmp_path_factory.mktemp("learned")
    tok = build_char_tokenizer()
    lm = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    save_checkpoint(lm, tok, root / "lm")
    torch.manual_seed(0)
    save_checkpoint(build_reward_model(lm, "orm", tok), tok, root / "orm")
    prm = build_reward_model(lm, "prm", tok, num_labels=2)
    setattr(prm.config, PRM_META_KEY, {"separator": "\n", "split": "think"})
    save_checkpoint(prm, tok, root / "prm")
    return {"lm": str(root / "lm"), "orm": str(root / "orm"), "prm": str(root / "prm")}


def test_rewards_package_imports_without_torch():
    code = "import sys, posttrain.rewards; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_recipe_entries_with_extra_keys(scorers):
    spec = RewardSpec.from_dict({"name": "process_reward_model", "path": scorers["prm"],
                                 "aggregate": "prod", "weight": 0.5})
    assert spec.kwargs == {"path": scorers["prm"], "aggregate": "prod"} and spec.weight == 0.5
    validate_specs([spec])


def test_a_path_that_is_not_a_scorer_fails_before_loading(scorers, tmp_path):
    cases = [
        ({"name": "reward_model", "path": scorers["lm"]}, "LlamaForCausalLM.*not an outcome"),
        ({"name": "reward_model", "path": scorers["prm"]}, "not an outcome reward model"),
        ({"name": "process_reward_model", "path": scorers["orm"]}, "not a process reward"),
        ({"name": "reward_model", "path": str(tmp_path / "nothing")}, "expected a directory"),
        ({"name": "reward_model"}, "'path' is required"),
        ({"name": "process_reward_model", "path": scorers["prm"], "aggregate": "max"},
         "aggregate='max'; valid"),
        ({"name": "reward_model", "path": scorers["orm"], "pth": 1}, r"unknown key\(s\) \['pth'\]"),
    ]
    for entry, msg in cases:
        with pytest.raises(ValueError, match=msg):
            validate_specs([RewardSpec.from_dict(entry)])


def test_batched_scores_match_one_by_one(scorers):
    specs = [RewardSpec.from_dict({"name": "reward_model", "path": scorers["orm"]}),
             RewardSpec.from_dict({"name": "process_reward_model", "path": scorers["prm"],
                                   "aggregate": "min"}),
             RewardSpec("math")]
    scorer = Rewards(specs)
    rows = [{"prompt": PROMPT, "answer": "57"}] * 2
    result = scorer.score([GOOD, BAD], rows)
    alone = [scorer.score([c], rows[:1]) for c in (GOOD, BAD)]
    for name in ("reward_model", "process_reward_model"):
        got = result.per_function[name]
        assert got == pytest.approx([a.per_function[name][0] for a in alone], abs=1e-5)
    assert result.per_function["math"] == [1.0, 0.0]
    assert all(0.0 < p < 1.0 for p in result.per_function["process_reward_model"])
    expected = [result.per_function["reward_model"][i] + result.per_function[
        "process_reward_model"][i] + result.per_function["math"][i] for i in range(2)]
    assert result.scores == pytest.approx(expected)


def test_process_scorer_step_scores_and_aggregation(scorers):
    prm = get_reward_model(scorers["prm"], "prm")
    assert isinstance(prm, ProcessRewardModel)
    assert get_reward_model(scorers["prm"], "prm") is prm  # cached
    assert prm.split(GOOD) == ["12+7=19", "19*3=57", "<answer>57</answer>"]
    steps = prm.step_scores([PROMPT, PROMPT], [GOOD, BAD])
    assert [len(s) for s in steps] == [3, 3]
    # a partial solution's step scores are the prefix of the full one's (causal model)
    partial = prm.score_steps([PROMPT], [["12+7=19", "19*3=57"]])[0]
    assert partial == pytest.approx(steps[0][:2], abs=1e-5)
    for how, fn in (("min", min), ("prod", math.prod), ("last", lambda s: s[-1]),
                    ("mean", lambda s: sum(s) / len(s))):
        assert prm.score([PROMPT], [GOOD], how)[0] == pytest.approx(fn(steps[0]), abs=1e-5)
    assert aggregate_scores([[0.5, 0.2], []], "min") == pytest.approx([0.2, 0.0])
    assert prm.step_scores([PROMPT], [""]) == [[]]


def test_grpo_recipe_with_a_bad_reward_model_path_fails_before_loading(scorers, tmp_path):
    from posttrain.config import ConfigError, GRPOConfig, build_config
    from posttrain.tasks.arithmetic import prompt_rows, write_jsonl
    from posttrain.trainers.grpo import GRPOTrainer

    data = write_jsonl(prompt_rows(4), tmp_path / "p.jsonl")
    cfg = build_config(GRPOConfig, overrides={
        "model": str(tmp_path / "no-model"), "train_data": str(data),
        "rewards": [{"name": "math"}, {"name": "reward_model", "path": scorers["lm"]}]})
    with pytest.raises(ConfigError, match="reward_model.*not an outcome reward model"):
        GRPOTrainer(cfg)
