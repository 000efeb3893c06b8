"""Dataset loading, per-kind validation and prompt rendering."""

from posttrain.data.loading import DataError, load_rows, read_jsonl, validate_rows
from posttrain.data.prompts import as_messages, render_prompt
from posttrain.data.schemas import SCHEMAS

__all__ = ["SCHEMAS", "DataError", "as_messages", "load_rows", "read_jsonl", "render_prompt",
           "validate_rows"]
