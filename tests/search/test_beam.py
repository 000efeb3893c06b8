"""PRM beam search with a scripted proposer and a hand-made step scorer."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.search import Candidate, PolicyProposer, prm_beam_search

STEP_SCORES = {"a": 0.9, "b": 0.8, "c": 0.1, "d": 0.5, "x": 0.2, "y": 0.9, "z": 1.0, "w": 0.1,
               # the answer block is the last step of a finished solution
               "<answer>1</answer>": 1.0, "<answer>2</answer>": 0.5,
               "<answer>3</answer>": 0.9, "<answer>4</answer>": 1.0}


def fake_scorer(prompts, steps):
    return [[STEP_SCORES[s] for s in row] for row in steps]


class Scripted:
    """Proposals per partial completion, repeated to fill n; records every call."""

    def __init__(self, tree):
        self.tree, self.calls = tree, []

    def __call__(self, contexts, n):
        self.calls.append(([prefix for _, prefix in contexts], n))
        out = []
        for _, prefix in contexts:
            options = self.tree[prefix]
            out.append([Candidate(*options[i % len(options)]) for i in range(n)])
        return out


TREE = {
    "": [("<think>a; ", 3, False), ("<think>b; ", 3, False), ("<think>c; ", 3, False),
         ("<think>d; ", 3, False)],
    "<think>a; ": [("x</think><answer>1</answer>", 5, True),
                   ("y</think><answer>2</answer>", 5, True)],
    "<think>b; ": [("z</think><answer>3</answer>", 7, True),
                   ("w</think><answer>4</answer>", 7, True)],
}


def test_beam_keeps_top_k_and_returns_best_finished():
    propose = Scripted(TREE)
    [res] = prm_beam_search(["p"], propose, fake_scorer, beam_width=2, expansions=2,
                            aggregate="prod")
    # round 1: B*M = 4 candidates from the prompt; a (0.9) and b (0.8) are kept, not d/c
    assert propose.calls[0] == ([""], 4)
    assert propose.calls[1] == (["<think>a; ", "<think>b; "], 2)
    # round 2 (steps, then answer): a,x,1 = 0.9*0.2*1.0 = 0.18; a,y,2 = 0.9*0.9*0.5 = 0.405;
    # b,z,3 = 0.8*1.0*0.9 = 0.72; b,w,4 = 0.8*0.1*1.0 = 0.08 -> keep z and y, both finished
    assert res.completion == "<think>b; z</think><answer>3</answer>"
    assert res.score == pytest.approx(0.72)
    assert res.finished == 2 and res.rounds == 2
    assert res.tokens == 4 * 3 + 2 * 5 + 2 * 7  # every sampled candidate counts


def test_beam_last_aggregate_changes_the_choice():
    [res] = prm_beam_search(["p"], Scripted(TREE), fake_scorer, beam_width=2, expansions=2,
                            aggregate="last")
    # round 1 is the same (last = the only step); round 2 by the answer step alone:
    # a,x,1 = 1.0 and b,w,4 = 1.0 beat b,z,3 = 0.9; the first of the tie wins
    assert res.completion == "<think>a; x</think><answer>1</answer>"
    assert res.score == 1.0


def test_beam_dedupes_identical_candidates():
    tree = dict(TREE, **{"": [("<think>a; ", 1, False)] * 3 + [("<think>b; ", 1, False)]})
    propose = Scripted(tree)
    prm_beam_search(["p"], propose, fake_scorer, beam_width=2, expansions=2)
    assert propose.calls[1][0] == ["<think>a; ", "<think>b; "]
    propose = Scripted(tree)
    prm_beam_search(["p"], propose, fake_scorer, beam_width=2, expansions=2, dedupe=False)
    assert propose.calls[1][0] == ["<think>a; ", "<think>a; "]


def test_beam_step_limit_without_finish_and_several_prompts():
    loop = {"": [("<think>a; ", 1, False)], "<think>a; ": [("a; ", 1, False)],
            "<think>a; a; ": [("a; ", 1, False)]}
    propose = Scripted(dict(loop, **TREE))
    never, done = prm_beam_search(["p", "q"], _by_prompt(propose, loop), fake_scorer,
                                  beam_width=1, expansions=2, max_steps=3)
    assert never.completion == "" and never.score == -math.inf and never.rounds == 3
    assert never.tokens == 2 + 2 + 2  # 2 candidates per round (deduped to 1 beam)
    assert done.completion.startswith("<think>a; ") and done.finished == 1
    with pytest.raises(ValueError, match=">= 1"):
        prm_beam_search(["p"], propose, fake_scorer, beam_width=0)


def _by_prompt(scripted, loop):
    """Prompt "p" follows the never-ending `loop` tree, other prompts the TREE."""

    def propose(contexts, n):
        out = []
        for prompt, prefix in contexts:
            tree = loop if prompt == "p" else TREE
            options = tree[prefix]
            out.append([Candidate(*options[i % len(options)]) for i in range(n)])
        return out

    return propose


def test_policy_proposer_stops_at_step_boundaries():
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=0)
    propose = PolicyProposer(model, tok, max_step_tokens=12,
                             generator=torch.Generator().manual_seed(0))
    assert propose.stop_ids == [tok.convert_tokens_to_ids(";")]
    contexts = [("1+2-3", ""), ("4*5", "<think>4*5=20; ")]
    out = propose(contexts, 8)
    assert [len(c) for c in out] == [8, 8]
    cands = [c for row in out for c in row]
    assert all(1 <= c.tokens <= 12 for c in cands)
    for c in cands:
        if not c.done:  # ended at the separator: exactly one, at the end
            assert c.text.endswith("; ") and c.text.count(";") == 1
    assert any(not c.done for c in cands) or all(c.tokens == 12 or c.done for c in cands)


def test_policy_proposer_follows_chat_template():
    from posttrain.data.prompts import TemplateError
    from posttrain.tasks.tiny import build_tiny_llama
    from posttrain.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, seed=0)
    assert PolicyProposer(model, tok).render("1+2") == "<s>1+2\n"
    plain = PolicyProposer(model, tok, template="none")
    assert plain.render("1+2") == "1+2"
    with pytest.raises(TemplateError):
        plain.render([{"role": "user", "content": "1+2"}])
