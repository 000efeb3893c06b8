"""Load dataset rows (JSONL, JSON, parquet, ``datasets`` directories or Hub names) and validate
them against a kind's schema before any model is loaded.

Every problem becomes a :class:`DataError` naming the file, the line (1-based; for ``datasets``
sources the row index), the field and what was expected. Up to ``MAX_REPORTED`` problems are
reported at once so a user can fix a file in one pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from posttrain.data import hub
from posttrain.data.schemas import normalize_row, row_problems, schema

MAX_REPORTED = 10
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


class DataError(ValueError):
    """A malformed dataset: ``source``, ``line`` (or None), ``field`` (or None), ``message``.

    ``str(err)`` reads ``data.jsonl:3: field 'answer': expected a string, got list``; when
    several rows are bad, the further problems follow on their own lines.
    """

    def __init__(self, source: str, line: int | None, field: str | None, message: str,
                 more: list[str] | None = None) -> None:
        self.source, self.line, self.field, self.message = source, line, field, message
        self.more = more or []
        where = source if line is None else f"{source}:{line}"
        head = f"{where}: {message}" if field is None else f"{where}: field '{field}': {message}"
        super().__init__("\n".join([head, *self.more]))

    def __reduce__(self) -> tuple:  # crosses process pools with its message intact
        return type(self), (self.source, self.line, self.field, self.message, self.more)


def read_jsonl(path: str | Path) -> list[tuple[int, Any]]:
    """``(line number, parsed object)`` for each non-blank line; a JSON array file works too."""
    path = Path(path)
    if not path.is_file():
        raise DataError(str(path), None, None, "file not found")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(str(path), err.lineno, None, f"invalid JSON ({err.msg})") from err
        return [(i + 1, item) for i, item in enumerate(items)]
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataError(str(path), number, None,
                            f"invalid JSON ({err.msg} at column {err.colno}); expected one "
                            "JSON object per line") from err
    return out


def rename_columns(row: Any, columns: Mapping[str, str] | None) -> Any:
    """Map source columns to schema fields: ``columns={"prompt": "question"}``."""
    if not columns or not isinstance(row, dict):
        return row
    out = {k: v for k, v in row.items() if k not in columns.values()}
    for field, column in columns.items():
        if column in row:
            out[field] = row[column]
    return out


def _required_problems(row: Any, require: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """Fields a consumer (a reward function) needs that are missing or null in ``row``."""
    if not require or not isinstance(row, dict):
        return []
    return [(f, f"{'missing' if f not in row else 'null'} ({why})")
            for f, why in require.items() if row.get(f) is None]


def _column_hint(field: str, raw: Any, columns: Mapping[str, str] | None, kind: str) -> str:
    """For a missing field: the row's columns and how to map one to the field."""
    if not isinstance(raw, dict) or (columns and field in columns) or field in raw:
        return ""
    if kind == "unpaired" and {"chosen", "rejected"} <= set(raw):
        return ""  # preference pairs: said by the schema, no column to map
    if field == "prompt" and kind in ("prompts", "code") and (sft := _sft_column(raw)):
        return (f"; the row's '{sft}' is a whole conversation ending with the assistant's "
                f"answer (an SFT row): give RL the prompt without that final assistant message "
                f"({{prompt: {sft}[:-1], answer: ...}}), or train on these rows with "
                f"`posttrain sft` (mapped as it is, the answer would be inside the prompt)")
    required, optional = schema(kind)
    have = sorted(map(str, raw))
    others = [c for c in have if c not in required and c not in optional]
    if not others:
        return ""
    pick = next((c for c in _LIKELY.get(field, ()) if c in others), None) or (
        others[0] if len(others) == 1 else "<column>")
    return f"; the row has columns {have}: map one with columns={{{field}: {pick}}}"


def _sft_column(raw: dict) -> str | None:
    """The column holding a chat conversation whose last message is the assistant's, if any."""
    for key, value in raw.items():
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value) \
                and value[-1].get("role") == "assistant":
            return str(key)
    return None


_LIKELY = {"prompt": ("question", "problem", "query", "instruction", "input", "text"),
           "answer": ("solution", "final_answer", "target", "label", "output"),
           "completion": ("response", "output", "answer", "target")}


def validate_rows(numbered: Iterable[tuple[int, Any]], kind: str, source: str,
                  columns: Mapping[str, str] | None = None,
                  require: Mapping[str, str] | None = None) -> list[dict]:
    """Check every row against ``kind``; return normalized rows or raise :class:`DataError`.

    ``require``: field -> why it is needed (``"reward 'math' reads it"``); such a field must be
    present and not null in every row (after ``columns`` renames).
    """
    schema(kind)  # unknown kind -> ValueError listing the valid ones
    rows, errors = [], []
    missing: dict[str, int] = {}  # a field missing from many rows is reported once, counted
    for number, raw in numbered:
        row = rename_columns(raw, columns)
        for field, msg in row_problems(row, kind) + _required_problems(row, require):
            if msg.startswith("missing") and field in missing:
                missing[field] += 1
                continue
            if msg.startswith("missing"):
                missing[field] = 1
                msg += _column_hint(field, raw, columns, kind)
            if columns and field in columns:
                msg = f"{msg} (read from column '{columns[field]}')"
            errors.append((number, field, msg))
        if not errors:
            rows.append(normalize_row(row, kind))
        if len(errors) >= MAX_REPORTED:
            break
    errors = [(n, f, f"{m} (missing from {missing[f]} rows)" if missing.get(f, 0) > 1 else m)
              for n, f, m in errors]
    if errors:
        line, field, msg = errors[0]
        more = [f"{source}:{n}: field '{f}': {m}" for n, f, m in errors[1:]]
        raise DataError(source, line, None if field == "<row>" else field, msg, more)
    if not rows:
        raise DataError(source, None, None,
                        f"the dataset is empty; expected at least one '{kind}' row")
    return rows


def _datasets_rows(source: str, split: str, subset: str | None) -> list[tuple[int, Any]]:
    """Rows of a parquet file, a ``save_to_disk`` directory or a Hub dataset name."""
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - datasets is a dependency
        raise DataError(source, None, None, "reading this source needs `datasets`") from err
    path = Path(source)
    if not path.exists() and not hub.hub_reachable():
        raise DataError(source, None, None,
                        "not a local file or directory, and the Hugging Face Hub is unreachable "
                        "(offline machine or HF_HUB_OFFLINE=1): download the dataset on a "
                        "connected machine (e.g. `datasets.load_dataset(...).save_to_disk(DIR)` "
                        "or `.to_parquet(FILE)`) and pass the local path")
    try:
        if path.suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        elif path.is_dir() and (path / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(path))
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        elif path.is_dir() and (path / "state.json").exists():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(source, subset, split=split)
    except Exception as err:  # every loader failure becomes one clear error
        hint = "" if path.exists() else (
            " (not a local file, so it was looked up on the Hugging Face Hub; the machine "
            "may be offline or the name wrong: download it elsewhere and pass a local path)")
        raise DataError(source, None, None,
                        f"could not load split '{split}'{hint}: {type(err).__name__}: {err}"
                        ) from err
    return [(i + 1, row) for i, row in enumerate(ds)]


def in_memory_rows(source: Any, split: str, name: str) -> list[Any]:
    """The rows of a Python object: a list or `datasets.Dataset` as it is, a pandas DataFrame
    as its records, a `DatasetDict` as its `split` (or its only split; else a DataError
    naming its splits)."""
    kind = type(source).__name__
    if kind == "DataFrame" and callable(getattr(source, "to_dict", None)):
        return source.to_dict("records")
    if kind in ("DatasetDict", "IterableDatasetDict") or (
            isinstance(source, Mapping) and source and
            all(hasattr(v, "column_names") for v in source.values())):
        splits = list(source)
        if split in splits or len(splits) == 1:
            return list(source[split if split in splits else splits[0]])
        raise DataError(name, None, None, f"a DatasetDict with splits {splits} and none named "
                        f"'{split}': pass one split (dataset['{splits[0]}']) or set the "
                        "split key (train_split / eval_split)")
    return list(source)


def load_rows(
    source: str | Path,
    kind: str,
    *,
    split: str = "train",
    subset: str | None = None,
    columns: Mapping[str, str] | None = None,
    limit: int | None = None,
    require: Mapping[str, str] | None = None,
) -> list[dict]:
    """Load and validate a dataset of ``kind`` (see :mod:`posttrain.data.schemas`).

    ``source`` is a ``.jsonl``/``.json`` file (line numbers in errors), a ``.parquet`` file, a
    ``datasets.save_to_disk`` directory or a Hub dataset name (1-based row numbers in errors).
    ``columns`` renames source columns to schema fields; ``limit`` keeps the first rows;
    ``require`` names fields every row must carry (see :func:`validate_rows`).
    """
    schema(kind)
    name = str(source)
    numbered = (read_jsonl(name) if name.endswith(_JSON_SUFFIXES)
                else _datasets_rows(name, split, subset))
    if limit is not None:
        numbered = numbered[:limit]
    return validate_rows(numbered, kind, name, columns, require)
