"""Format reward: 0.1 for a non-empty <think> block that precedes a complete <answer> block."""

from __future__ import annotations

import pytest

from posttrain.rewards import format_reward

CASES = [
    ("<think>12+7=19</think><answer>19</answer>", 0.1),
    ("<think>\nreason\n</think>\n<answer>19</answer>", 0.1),
    ("preamble <think>r</think> text <answer>19</answer> tail", 0.1),
    ("<think></think><answer>19</answer>", 0.0),  # empty reasoning
    ("<think>   </think><answer>19</answer>", 0.0),  # blank reasoning
    ("<answer>19</answer><think>late</think>", 0.0),  # answer before think
    ("<answer>1</answer><think>r</think><answer>19</answer>", 0.0),  # an answer tag before
    ("<think>r</think>", 0.0),  # no answer
    ("<think>r</think><answer>19", 0.0),  # unclosed answer
    ("<think>r<answer>19</answer>", 0.0),  # unclosed think
    ("19", 0.0),
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "reward"), CASES)
def test_format_reward(completion: str, reward: float) -> None:
    assert format_reward(completion) == reward
