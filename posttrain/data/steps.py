"""The step format: how a completion is cut into reasoning steps, for PRMs everywhere.

One rule set for PRM training, the learned reward, process supervision and search; a saved PRM
stores its rule in config.json (``posttrain_prm.split``), and that rule is the one used.

* ``"think"`` (default): ``<think>s1; s2; s3</think><answer>a</answer>``: each ``;``-separated
  part of the reasoning is a step, the ``<answer>`` block one final step; an unclosed ``<think>``
  has the steps written so far; a completion without a step in either block is ONE step.
* any other string: a literal delimiter (``"\\n"``: one step per line, GSM8K / PRM800K style).

Steps are stripped and blank ones skipped, so only a blank completion has no step; such a
completion scores ``posttrain.models.reward_models.EMPTY_SCORE`` (0.0) everywhere.
More: docs/process_supervision.md, "Module notes", posttrain.data.steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

THINK = "think"
THINK_OPEN, THINK_CLOSE, THINK_DELIMITER = "<think>", "</think>", ";"
_ANSWER_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def step_spans(completion: str, rule: str = THINK) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the steps of ``completion`` under ``rule``.

    ``completion[start:end]`` is step ``i`` (stripped); ``completion[:end]`` is the prefix a
    Math-Shepherd rollout continues from. See the module doc for the rules.
    """
    if not rule:
        raise ValueError("step split: a rule must be 'think' or a non-empty delimiter")
    if rule != THINK:
        return _pieces(completion, 0, len(completion), rule)
    spans: list[tuple[int, int]] = []
    rest = 0
    start = completion.find(THINK_OPEN)
    if start >= 0:
        body = start + len(THINK_OPEN)
        close = completion.find(THINK_CLOSE, body)
        end = close if close >= 0 else len(completion)
        spans = _pieces(completion, body, end, THINK_DELIMITER)
        rest = close + len(THINK_CLOSE) if close >= 0 else len(completion)
    answer = _ANSWER_RE.search(completion, rest)
    if answer:
        spans.append((answer.start(), answer.end()))
    if not spans:  # no step in either block: the whole (non-blank) completion is one step
        spans = _pieces(completion, 0, len(completion), None)
    return spans


def _pieces(text: str, start: int, end: int, delimiter: str | None) -> list[tuple[int, int]]:
    """Stripped, non-blank spans of ``text[start:end]`` split on ``delimiter`` (None: whole)."""
    parts = text[start:end].split(delimiter) if delimiter else [text[start:end]]
    spans = []
    for piece in parts:
        a, b = start, start + len(piece)
        start = b + (len(delimiter) if delimiter else 0)
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if b > a:
            spans.append((a, b))
    return spans


def split_steps(completion: str, rule: str = THINK) -> list[str]:
    """The step texts of ``completion`` (see :func:`step_spans`)."""
    return [completion[a:b] for a, b in step_spans(completion, rule)]


def first_error(labels: Sequence[int]) -> int:
    """Index of the first negative (-1) step label, or ``len(labels)`` when there is none."""
    return next((i for i, v in enumerate(labels) if v == -1), len(labels))
