"""Conversational rows (TRL's conversational formats) turned into prompt + completion.

* SFT ``{"messages": [...]}``: the prompt is every message before the LAST assistant message,
  the completion is that message (earlier assistant turns are context, not trained on: to
  train on every turn, write one row per turn).
* SFT ``{"prompt": [...], "completion": [...]}``: conversational prompt/completion, as is.
* Preferences with ``chosen`` / ``rejected`` as message lists: the prompt is the leading
  messages both share (UltraFeedback's shape, where each side is the whole conversation), or
  the row's ``prompt`` when the two sides hold only their own assistant message(s).

A check returns ``None`` or a ``(field, problem)`` pair; ``split_*`` assume a checked row.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.prompts import as_messages

Messages = list[dict[str, Any]]


def message_problem(value: Any) -> str | None:
    """None if ``value`` is a non-empty list of ``{"role": str, "content": str}``."""
    if not isinstance(value, list) or not value:
        return ("expected a non-empty list of chat messages ({'role': str, 'content': str}), "
                f"got {type(value).__name__ if value is not None else 'null'}")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            return f"message {i}: expected an object with 'role' and 'content'"
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                return f"message {i}: expected '{key}' to be a string"
    return None


def last_assistant(messages: Messages) -> int:
    """Index of the last assistant message, or -1."""
    return max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)


def sft_messages_problem(row: dict) -> tuple[str, str] | None:
    """Problems of an SFT ``messages`` row."""
    if (msg := message_problem(row["messages"])) is not None:
        return "messages", msg
    last = last_assistant(row["messages"])
    if last < 0:
        return "messages", "expected an assistant message to train on, found none"
    if last == 0:
        return "messages", "expected at least one message (the prompt) before the last " \
                           "assistant message"
    return None


def split_messages(row: dict) -> dict:
    """``{"messages"}`` -> ``{"prompt": messages before the last assistant turn, "completion":
    [that turn]}`` (other fields kept)."""
    messages = row["messages"]
    last = last_assistant(messages)
    out = {k: v for k, v in row.items() if k != "messages"}
    return {**out, "prompt": list(messages[:last]), "completion": [messages[last]]}


def shared_prefix(a: Messages, b: Messages) -> int:
    """How many leading messages ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def preference_problem(row: dict) -> tuple[str, str] | None:
    """Cross-field problems of a preference row whose sides are message lists (types checked)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        return "rejected", "expected the same type as 'chosen' (both strings or both lists " \
                           "of chat messages)"
    if isinstance(chosen, str):
        return None if "prompt" in row else ("prompt", "missing (required with string "
                                                       "'chosen' / 'rejected')")
    n = shared_prefix(chosen, rejected)
    if n == len(chosen) or n == len(rejected):
        return "rejected", "expected 'chosen' and 'rejected' to differ after their shared " \
                           "prompt messages"
    if n == 0 and "prompt" not in row:
        return "prompt", "missing: 'chosen' and 'rejected' share no leading messages, so the " \
                         "prompt must be given (a string or chat messages)"
    if n and "prompt" in row and as_messages(row["prompt"]) != chosen[:n]:
        return "prompt", "differs from the leading messages that 'chosen' and 'rejected' " \
                         "share (the conversation's prompt); drop it or make them agree"
    return None


def split_preference(row: dict) -> dict:
    """A checked conversational preference row with ``prompt`` = the shared leading messages
    (when there are any) and each side = its own messages after them."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str):
        return row
    n = shared_prefix(chosen, rejected)
    if n == 0:
        return row
    return {**row, "prompt": list(chosen[:n]), "chosen": list(chosen[n:]),
            "rejected": list(rejected[n:])}

