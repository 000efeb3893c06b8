"""Math reward: extraction table, equivalence through math-verify, unscorable gold, hard timeout."""

from __future__ import annotations

import threading
from decimal import Decimal

import pytest

from posttrain.rewards import UnscorableError, extract_answer, math_reward
from posttrain.rewards.math import last_boxed, plain_number

EXTRACTION_CASES = [
    # (completion, expected extracted answer)
    ("<answer>42</answer>", "42"),
    ("<answer>  42 \n</answer>", "42"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),  # several answers: the last one
    ("<think>x</think><answer>\n-7\n</answer>", "-7"),
    ("so \\boxed{5}", "5"),
    ("\\boxed{1} and finally \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces stay balanced
    ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
    ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
    ("<answer>The value is \\boxed{9}</answer>", "9"),  # boxed inside the answer tag wins
    ("<answer>3</answer> \\boxed{4}", "3"),  # an answer tag beats a later boxed
    ("\\boxed{7} \\boxed{unclosed", "7"),  # an unbalanced last box falls back to the previous
    ("no answer here", None),
    ("<answer>   </answer>", None),
    ("<answer>5", None),  # unclosed tag, no boxed
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACTION_CASES)
def test_extract_answer(completion: str, expected: str | None) -> None:
    assert extract_answer(completion) == expected


def test_last_boxed_none_when_absent() -> None:
    assert last_boxed("nothing boxed") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1,000", Decimal(1000)), ("$ -3 $", Decimal(-3)), ("0.50", Decimal("0.5")),
     (".5", Decimal("0.5")), ("+2", Decimal(2)), ("1/2", None), ("x", None), ("1e5", None),
     ("", None)],
)
def test_plain_number(text: str, expected: Decimal | None) -> None:
    assert plain_number(text) == expected


REWARD_CASES = [
    # (completion, gold, reward)
    ("<answer>42</answer>", "42", 1.0),
    ("<answer>41</answer>", "42", 0.0),
    ("<answer>-3</answer>", "-3", 1.0),
    ("<answer>3</answer>", "-3", 0.0),
    ("<answer>1,000</answer>", "1000", 1.0),  # fast path strips commas
    ("<answer>7.0</answer>", "7", 1.0),  # fast path compares exactly: 7.0 == 7
    ("<answer>0.5000001</answer>", "0.5", 0.0),  # ... and without rounding
    ("<answer>1/2</answer>", "0.5", 1.0),  # math-verify: fraction vs decimal
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),  # symbolic equivalence
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{\\pi}", "2\\pi", 0.0),
    ("no answer", "42", 0.0),
    ("<answer>forty-two</answer>", "42", 0.0),
]


@pytest.mark.parametrize(("completion", "gold", "reward"), REWARD_CASES)
def test_math_reward(completion: str, gold: str, reward: float) -> None:
    assert math_reward(completion, gold) == reward


@pytest.mark.parametrize("gold", ["", "   ", "\\frac{", "}{", "???"])
def test_unparseable_gold_is_unscorable(gold: str) -> None:
    with pytest.raises(UnscorableError):
        math_reward("<answer>3</answer>", gold)
    with pytest.raises(UnscorableError):  # same verdict when the completion has no answer
        math_reward("no answer", gold)


def test_hard_timeout_from_a_thread() -> None:
    """9^(9^9) makes sympy compute a 370-million-digit integer in C (minutes). From a worker
    thread math-verify's signal.alarm cannot work; our kill-the-worker limit must."""
    results: list[float] = []
    thread = threading.Thread(
        target=lambda: results.append(math_reward("\\boxed{9^{9^{9}}}", "3", timeout_s=1.0)))
    thread.start()
    thread.join(timeout=60)  # liveness guard, not a speed check
    assert not thread.is_alive()
    assert results == [0.0]
    # the pool recovered: the next check from a thread works and is right
    again: list[float] = []
    thread = threading.Thread(target=lambda: again.append(math_reward("\\boxed{1/2}", "0.5")))
    thread.start()
    thread.join(timeout=60)
    assert again == [1.0]
