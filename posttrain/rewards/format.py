"""Format reward (formulas §10): +0.1 when the reasoning is wrapped in ``<think>...</think>``
before the answer.

Rule, exactly: the completion contains ``<think>X</think>`` where X (the text between the
first ``<think>`` and the first ``</think>`` after it) is not blank, and an
``<answer>...</answer>`` block starts after that ``</think>`` with no ``<answer>`` tag anywhere
before it. Text outside the tags is allowed (we do not demand the whole completion match a
template). ``<think>`` without a later answer block scores 0.0.
"""

from __future__ import annotations

FORMAT_BONUS = 0.1


def format_reward(completion: str) -> float:
    """0.1 if a non-empty ``<think>...</think>`` precedes an ``<answer>...</answer>``; else 0.0."""
    open_at = completion.find("<think>")
    if open_at == -1:
        return 0.0
    close_at = completion.find("</think>", open_at)
    if close_at == -1 or not completion[open_at + len("<think>") : close_at].strip():
        return 0.0
    answer_at = completion.find("<answer>")
    if answer_at == -1 or answer_at < close_at:
        return 0.0
    if completion.find("</answer>", answer_at) == -1:
        return 0.0
    return FORMAT_BONUS
