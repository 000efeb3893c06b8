"""Turn a dataset prompt (a string or a list of chat messages) into model input text."""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, Any]]


def as_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """A str prompt becomes one user message; a message list is returned as is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def render_prompt(tokenizer: Any, prompt: Prompt) -> str:
    """The text the model continues: the chat template with the generation prompt added.

    Tokenize the result with ``add_special_tokens=False``: the template already holds any BOS.
    A tokenizer without a chat template gets the raw string (message contents joined by
    newlines), which is what base models expect.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            as_messages(prompt), tokenize=False, add_generation_prompt=True
        )
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)
