"""The one step format (posttrain.data.steps): table-driven splits, spans and first errors."""

from __future__ import annotations

import pytest

from posttrain.data.steps import first_error, split_steps, step_spans

GOOD = "<think>12+7=19; 19*3=57; 57-5=52</think><answer>52</answer>"


@pytest.mark.parametrize(("completion", "steps"), [
    (GOOD, ["12+7=19", "19*3=57", "57-5=52", "<answer>52</answer>"]),
    ("<think>12+7=19; ", ["12+7=19"]),  # partial (beam search): trailing delimiter
    ("<think>12+7=19; 19*3", ["12+7=19", "19*3"]),  # partial: unclosed <think>
    ("<think> a ;; b</think>", ["a", "b"]),  # stripped, blank steps skipped
    ("<think></think><answer>1</answer>", ["<answer>1</answer>"]),
    ("<answer>1</answer>", ["<answer>1</answer>"]),
    ("  no blocks at all \n", ["no blocks at all"]),  # unparseable: the whole text is one step
    ("<think></think>", ["<think></think>"]),  # no step inside either block: one step too
    ("", []),  # only a blank completion has no step
    (" \n ", []),
])
def test_think_rule(completion: str, steps: list[str]) -> None:
    assert split_steps(completion) == steps


def test_spans_are_the_rollout_prefixes() -> None:
    spans = step_spans(GOOD)
    assert [GOOD[a:b] for a, b in spans] == split_steps(GOOD)
    assert GOOD[:spans[1][1]] == "<think>12+7=19; 19*3=57"  # the prefix after step 2


def test_literal_delimiter_rule() -> None:
    assert split_steps("a\n\nb\n", "\n") == ["a", "b"]
    assert split_steps("<think>a | b</think>", " | ") == ["<think>a", "b</think>"]
    text = "x = 1\n  y = 2  \n"
    assert [text[a:b] for a, b in step_spans(text, "\n")] == ["x = 1", "y = 2"]
    with pytest.raises(ValueError, match="delimiter"):
        split_steps("a", "")


def test_first_error() -> None:
    assert first_error([1, 1, -1, -1]) == 2
    assert first_error([1, 0]) == 2  # neutral is not an error
    assert first_error([]) == 0
