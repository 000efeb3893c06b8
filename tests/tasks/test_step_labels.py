import pytest
import torch

from posttrain.data.steps import first_error, split_steps
from posttrain.tasks.step_labels import (
    exact_labels,
    label_agreement,
    math_shepherd_labels,
    pair_rows,
)
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer

# 12+7*3-5 = ((12+7)*3)-5: true values 19, 57, 52
PROBLEM = "12+7*3-5"
GOOD = "<think>12+7=19; 19*3=57; 57-5=52</think><answer>52</answer>"


def test_exact_labels_conventions():
    assert exact_labels(PROBLEM, split_steps(GOOD)) == [1, 1, 1, 1]
    # wrong result at step 2; step 3 is right GIVEN its (wrong) input but still -1
    wrong = "<think>12+7=19; 19*3=56; 56-5=51</think><answer>51</answer>"
    assert exact_labels(PROBLEM, split_steps(wrong)) == [1, -1, -1, -1]
    assert exact_labels(PROBLEM, split_steps(wrong), "truncate") == [1, -1]
    # wrong INPUT: the step copies 18 instead of 19 (arithmetic itself is fine)
    bad_input = "<think>12+7=19; 18*3=54; 54-5=49</think><answer>49</answer>"
    assert exact_labels(PROBLEM, split_steps(bad_input)) == [1, -1, -1, -1]
    # sign dropped (the SFT flaw): 5-9 = -4 written as 4
    assert exact_labels("5-9+1", ["5-9=4", "4+1=5", "<answer>5</answer>"]) == [-1, -1, -1]
    # too few steps: the chain stops early, the answer step is wrong
    assert exact_labels(PROBLEM, ["12+7=19", "19*3=57", "<answer>57</answer>"]) == [1, 1, -1]
    # malformed step, extra step
    assert exact_labels(PROBLEM, ["12 plus 7"]) == [-1]
    assert exact_labels("1+2", ["1+2=3", "3+0=3", "<answer>3</answer>"]) == [1, -1, -1]
    with pytest.raises(ValueError, match="after_first_error"):
        exact_labels(PROBLEM, ["x"], "drop")


def test_first_error_and_agreement():
    assert first_error([1, 1, -1, -1]) == 2 and first_error([1, 0]) == 2
    a = [{"labels": [1, -1]}, {"labels": [1, 1, 1]}]
    b = [{"labels": [1, 1]}, {"labels": [1, 1, -1]}]
    agree = label_agreement(a, b)
    assert agree["step_agreement"] == pytest.approx(3 / 5)
    assert agree["bad_rate_exact"] == pytest.approx(1 / 5)


def test_pair_rows_pick_correct_vs_incorrect():
    rows = [{"prompt": "p", "completion": c, "correct": ok, "answer": "1"}
            for c, ok in (("a", True), ("b", False), ("c", False))]
    rows.append({"prompt": "q", "completion": "d", "correct": True, "answer": "2"})
    pairs = pair_rows(rows, per_prompt=5)
    assert {(p["chosen"], p["rejected"]) for p in pairs} == {("a", "b"), ("a", "c")}
    assert len(pair_rows(rows, per_prompt=1)) == 1



def test_math_shepherd_labels_from_rollouts():
    """A tiny random model rarely reaches the answer: the labels come from the rollouts' own
    verification, and the final step from the sample's correctness."""
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64)
    rows = [{"prompt": PROBLEM, "completion": GOOD, "answer": "52"},
            {"prompt": PROBLEM, "completion": GOOD.replace("52", "50"), "answer": "52"}]
    out = math_shepherd_labels(model, tok, rows, k=2, max_new_tokens=8)
    assert [len(r["labels"]) for r in out] == [4, 4]
    assert out[0]["labels"][-1] == 1 and out[1]["labels"][-1] == -1  # the answer step
    assert out[0]["soft_labels"][-1] == 1.0 and out[1]["soft_labels"][-1] == 0.0
    for r in out:
        assert all(q in (0.0, 0.5, 1.0) for q in r["soft_labels"])
        assert r["labels"] == [1 if q > 0 else -1 for q in r["soft_labels"]]


def test_exact_labels_on_the_hard_split():
    """Exact labels work for hard problems: the reference trace is all good, an injected error
    is caught at its step, and the label problems are hard ones of their own stream."""
    import random

    from posttrain.tasks import arithmetic as A
    from posttrain.tasks.step_labels import problems

    hard = problems(40, 0, "train", "hard")
    assert all(len(p.ops) == 4 and not A.is_heldout(p) for p in hard)
    assert [p.text for p in hard] != [p.text for p in problems(40, 0, "train")]
    assert all(A.is_heldout(p) for p in problems(10, 0, "heldout", "hard"))
    rng = random.Random(0)
    for p in hard:
        text, labels = A.render_trace(p, rng)
        assert exact_labels(p, split_steps(text)) == [1, 1, 1, 1, 1]
        steps, labels, _ = A.trace_steps(p, rng, error_rate=0.5)
        got = exact_labels(p, [*steps, f"<answer>{p.answer}</answer>"])
        first = labels.index(-1) if -1 in labels else 4
        assert got[:4] == [1] * first + [-1] * (4 - first)
