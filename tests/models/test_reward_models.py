"""The one ORM / PRM reward-model path (posttrain.models.reward_models): the same saved PRM gives
the same score to the same completion as a GRPO reward, in process supervision and in test-time
search."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, SearchConfig
from posttrain.models.loading import save_checkpoint
from posttrain.models.reward import PRM_META_KEY, build_reward_model
from posttrain.models.reward_models import EMPTY_SCORE, aggregate_scores
from posttrain.rewards.registry import Rewards, RewardSpec
from posttrain.search import Candidate, prm_beam_search, prm_outcome
from posttrain.search.command import check_verifiers
from posttrain.search.verifiers import load_orm_scorer, load_prm_scorer
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.process_steps import build_step_scorer

PROMPTS = ["12+7*3", "12+7*3", "5-9", "5-9", "2+2"]
COMPLETIONS = [
    "<think>12+7=19; 19*3=57</think><answer>57</answer>",
    "<think>12+7=18; 18*3=54</think>\n<answer>54</answer>",
    "the answer is -4",  # no <think> / <answer>: one step under the think rule
    "5-9=-4\n<answer>-4</answer>",  # two lines
    "",  # blank: no step anywhere, 0.0
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """An untrained ORM and two untrained PRMs (random heads), one per saved split rule."""
    root = tmp_path_factory.mktemp("scorers")
    tok = build_char_tokenizer()
    lm = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                          seed=0)
    torch.manual_seed(0)
    save_checkpoint(build_reward_model(lm, "orm", tok), tok, root / "orm")
    out = {"orm": str(root / "orm")}
    for name, rule in (("think", "think"), ("lines", "\n")):
        torch.manual_seed(1)
        prm = build_reward_model(lm, "prm", tok, num_labels=2)
        setattr(prm.config, PRM_META_KEY, {"separator": "\n", "split": rule})
        save_checkpoint(prm, tok, root / name)
        out[name] = str(root / name)
    return out


class OneShot:
    """A beam-search proposer whose only candidate is the completion itself, finished."""

    def __init__(self, completion: str) -> None:
        self.completion = completion

    def __call__(self, contexts, n):
        return [[Candidate(self.completion, 1, True)] for _ in contexts]


@pytest.mark.parametrize("rule", ["think", "lines"])
def test_one_prm_one_score_on_every_path(saved: dict[str, str], rule: str) -> None:
    path, rows = saved[rule], [{"prompt": p} for p in PROMPTS]
    # 1. the GRPO reward path: the registry's process_reward_model reward
    spec = RewardSpec.from_dict({"name": "process_reward_model", "path": path,
                                 "aggregate": "prod"})
    reward = Rewards([spec]).score(COMPLETIONS, rows).per_function["process_reward_model"]
    # 2. process supervision (advantage: grpo_process): step ends and per-step scores
    steps = build_step_scorer(path)(PROMPTS, COMPLETIONS)
    process = aggregate_scores([scores for _, scores in steps], "prod")
    # 3. test-time search: what `posttrain search` ranks and votes with, and beam search
    prm = load_prm_scorer(path)
    search = prm_outcome(prm, "prod")(PROMPTS, COMPLETIONS)
    beam = [prm_beam_search([p], OneShot(c), prm, beam_width=1, expansions=1,
                            aggregate="prod")[0].score
            for p, c in zip(PROMPTS, COMPLETIONS, strict=True) if c]

    assert reward == process == search  # exactly, not approximately
    assert beam == pytest.approx(search[:-1], abs=1e-6)  # alone in its batch: float noise only
    assert search[-1] == EMPTY_SCORE and steps[-1] == ([], [])  # blank: no step, 0.0
    assert all(0.0 < s < 1.0 for s in search[:-1])  # every other completion reaches the PRM
    assert len(set(search[:-1])) == len(search) - 1
    n_steps = [len(scores) for _, scores in steps]
    # the PRM's SAVED rule cuts the steps, whatever a search recipe's separator says
    assert n_steps == ([3, 3, 1, 1, 0] if rule == "think" else [1, 2, 1, 2, 0])
    for (ends, _), c in zip(steps, COMPLETIONS, strict=True):  # each end closes its step
        assert all(c[:e].endswith(step) for e, step in zip(ends, prm.split(c), strict=True))


def test_one_orm_one_score(saved: dict[str, str]) -> None:
    rows = [{"prompt": p} for p in PROMPTS]
    spec = RewardSpec.from_dict({"name": "reward_model", "path": saved["orm"],
                                 "transform": "sigmoid"})
    reward = Rewards([spec]).score(COMPLETIONS, rows).per_function["reward_model"]
    assert reward == load_orm_scorer(saved["orm"])(PROMPTS, COMPLETIONS)
    raw = load_orm_scorer(saved["orm"], probability=False)(PROMPTS, COMPLETIONS)
    assert torch.sigmoid(torch.tensor(raw)).tolist() == pytest.approx(reward, abs=1e-7)


def test_search_refuses_a_beam_separator_the_prm_does_not_split_at(saved: dict[str, str],
                                                                   tmp_path: Path) -> None:
    def cfg(prm: str, separator: str) -> SearchConfig:
        return SearchConfig(model="m", eval_data="e", out_dir=str(tmp_path), prm=prm,
                            methods=["beam"], step_separator=separator)

    check_verifiers(cfg(saved["think"], "; "))  # the arithmetic task's boundary: fine
    check_verifiers(cfg(saved["lines"], "\n"))
    with pytest.raises(ConfigError, match=r"step_separator.*saved rule '\\n'"):
        check_verifiers(cfg(saved["lines"], "; "))
    with pytest.raises(ConfigError, match="'orm'.*not an outcome reward model"):
        check_verifiers(SearchConfig(eval_data="e", orm=saved["think"], methods=["best_of_n"]))
