"""Checks of rows against the tokenizer, right after it loads and before the model does:
conversational values need a chat template (`chat_template`), and prompts must fit the
model's context (and `max_prompt_len`), in tokens after rendering. Each failure is a
:class:`~posttrain.data.loading.DataError` naming the source, the row and the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.data.loading import DataError
from posttrain.data.prompts import no_template_reason, uses_template

CONVERSATIONAL_FIELDS = ("prompt", "completion", "chosen", "rejected")


def check_renderable(tokenizer: Any, rows: list[dict[str, Any]], source: str,
                     template: str) -> None:
    """A conversational value (a list of chat messages) where no chat template applies is an
    error naming its row and field, never flattened with its roles dropped."""
    if uses_template(tokenizer, template):
        return
    for i, row in enumerate(rows):
        for field in CONVERSATIONAL_FIELDS:
            if isinstance(row.get(field), list):
                raise DataError(source, i + 1, field, no_template_reason(template))


def check_prompt_lengths(tokenizer: Any, rows: list[dict[str, Any]], source: str,
                         render: Callable[[Any], str], limit: int, why: str) -> None:
    """Every row's rendered prompt fits in `limit` tokens (`why` says where the limit comes
    from); the first that does not is an error naming its row."""
    texts = [render(r["prompt"]) for r in rows]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    over = [i for i, n in enumerate(lengths) if n > limit]
    if over:
        i = over[0]
        raise DataError(source, i + 1, "prompt",
                        f"{lengths[i]} tokens after rendering, over {why} ({len(over)} of "
                        f"{len(rows)} rows are; longest {max(lengths)} tokens)")
