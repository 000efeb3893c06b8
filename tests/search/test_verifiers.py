"""ORM / PRM checkpoints as search scorers: shapes, ranges, batch invariance, step alignment."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from posttrain.data.prompts import render_prompt
from posttrain.models.reward import build_reward_model, encode_steps, token_logits
from posttrain.models.reward_models import OutcomeRewardModel, ProcessRewardModel
from posttrain.ops.prm import step_scores_from_logits
from posttrain.search import prm_outcome
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer

COMPLETIONS = ["<think>1+2=3; 3*4=12</think><answer>12</answer>", "<answer>5</answer>",
               "<think>7-9=-2</think><answer>-2</answer>"]
PROMPTS = ["1+2*4", "2+3", "7-9"]


@pytest.fixture(scope="module")
def base():
    tok = build_char_tokenizer()
    lm = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                          seed=0)
    return lm, tok


def test_orm_scorer_probabilities_and_batch_invariance(base):
    lm, tok = base
    torch.manual_seed(0)
    orm = build_reward_model(lm, "orm", tok, num_labels=1)
    score = partial(OutcomeRewardModel(orm, tok, 2).score, transform="sigmoid")
    together = score(PROMPTS, COMPLETIONS)
    alone = [score([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert together == pytest.approx(alone, abs=1e-5)  # padding changes nothing
    assert all(0.0 < s < 1.0 for s in together)
    logits = OutcomeRewardModel(orm, tok).score(PROMPTS, COMPLETIONS)
    assert torch.sigmoid(torch.tensor(logits)).tolist() == pytest.approx(together, abs=1e-6)


def test_prm_scorer_reads_each_step_end(base):
    lm, tok = base
    torch.manual_seed(0)
    prm = build_reward_model(lm, "prm", tok, num_labels=2)
    prm.config.posttrain_prm = {"separator": "; ", "split": "think", "num_classes": 2}
    steps = [["1+2=3", "3*4=12", "<answer>12</answer>"], ["<answer>5</answer>"]]
    got = ProcessRewardModel(prm, tok, 1)(PROMPTS[:2], steps)
    assert [len(g) for g in got] == [3, 1]
    ids, ends = encode_steps(tok, render_prompt(tok, PROMPTS[0]), steps[0], "; ")
    assert tok.decode([ids[e] for e in ends]) == "   "  # each step ends on the separator's space
    probs = step_scores_from_logits(token_logits(prm, torch.tensor([ids]),
                                                 torch.ones(1, len(ids), dtype=torch.bool)))
    assert got[0] == pytest.approx(probs[0, ends].tolist(), abs=1e-5)
    # as an outcome scorer: product of the three step scores (split with the answer step)
    outcome = prm_outcome(ProcessRewardModel(prm, tok), "prod")(PROMPTS[:1], COMPLETIONS[:1])
    assert outcome[0] == pytest.approx(got[0][0] * got[0][1] * got[0][2], abs=1e-5)
