"""The tool of the conformance world's multi-turn cases (`grpo_tools`, `ppo_tools`)."""

from __future__ import annotations

TRACE = ('<tool_call>{"name": "echo", "arguments": {"x": "7"}}</tool_call></s>'
         "<tool_response>7</tool_response>\n<answer>7</answer>")
"""What the case's model is fine-tuned to write (at temperature 1 it garbles some of it)."""


def echo(x: str) -> str:
    """Return its argument.

    Args:
        x: any text.
    """
    return x
