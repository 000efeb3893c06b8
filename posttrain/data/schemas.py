"""Row schemas for every dataset kind, checked field by field.

Kinds (field by field in docs/trainers.md, "Module notes", posttrain.data.schemas): ``prompts``
(``prompt``, ``answer``?, ``tests``?), ``sft`` (``prompt`` + ``completion``, or ``messages``),
``preferences`` (``prompt``, ``chosen``, ``rejected``; with message lists the prompt may be the
shared leading messages, :mod:`posttrain.data.conversations`), ``steps`` (``prompt``, ``steps``,
``labels`` in 1 / 0 / -1), ``code`` (``prompt``, ``tests``, ``test_imports``?), ``outcomes``
(``prompt``, ``completion``, ``label`` 1 | 0) and ``unpaired`` (KTO: ``label`` true | false).

A chat message is ``{"role": str, "content": str}``. Integer or float answers become strings;
extra fields pass through untouched. A check returns ``None`` when the value is fine, else a
short description of what was expected and what was found; :mod:`posttrain.data.loading` adds
the file, line and field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.data.conversations import (
    message_problem,
    preference_problem,
    sft_messages_problem,
    split_messages,
    split_preference,
)

Check = Callable[[Any], str | None]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def check_str(value: Any) -> str | None:
    return None if _is_str(value) else f"expected a string, got {_type_name(value)}"


def check_prompt(value: Any) -> str | None:
    """A non-empty string, or a non-empty list of ``{"role": str, "content": str}``."""
    if isinstance(value, str):
        return None if value else "expected a non-empty string or chat-message list, got ''"
    if not isinstance(value, list) or not value:
        return ("expected a string or a non-empty list of chat messages "
                f"({{'role': str, 'content': str}}), got {_type_name(value)}")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            return (f"message {i}: expected an object with 'role' and 'content', "
                    f"got {_type_name(msg)}")
        for key in ("role", "content"):
            if not _is_str(msg.get(key)):
                return (f"message {i}: expected '{key}' to be a string, "
                        f"got {_type_name(msg.get(key))}")
    return None


def check_completion(value: Any) -> str | None:
    """A string, or a non-empty list of chat messages (conversational completion)."""
    if isinstance(value, str):
        return None
    if isinstance(value, list):
        return message_problem(value)
    return f"expected a string or a list of chat messages, got {_type_name(value)}"


def check_answer(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return f"expected a string (or number), got {_type_name(value)}"
    return None


def check_str_list(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"expected a non-empty list of strings, got {_type_name(value)}"
    for i, item in enumerate(value):
        if not _is_str(item):
            return f"item {i}: expected a string, got {_type_name(item)}"
    return None


def check_steps(value: Any) -> str | None:
    """A non-empty list of non-blank strings (an empty step has no end to label)."""
    if (msg := check_str_list(value)) is not None:
        return msg
    for i, item in enumerate(value):
        if not item.strip():
            return f"item {i}: expected a non-empty step, got {item!r}"
    return None


def check_labels(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"expected a non-empty list of 1 / 0 / -1, got {_type_name(value)}"
    for i, item in enumerate(value):
        if isinstance(item, bool) or item not in (1, 0, -1):
            return f"item {i}: expected 1, 0 or -1, got {item!r}"
    return None


def check_binary(value: Any) -> str | None:
    if value in (0, 1) and not isinstance(value, float):
        return None
    return f"expected 1 / 0 (or true / false), got {value!r}"


def stdio_problem(item: dict) -> str | None:
    """None if ``item`` is ``{"input": str, "output": str}``, else what is wrong with it."""
    if set(item) != {"input", "output"}:
        return (f"a dict test must have exactly the keys ['input', 'output'] (stdin/stdout "
                f"test), got keys {sorted(map(str, item))}; for APPS-style "
                "{'inputs': [...], 'outputs': [...]} make one test per pair")
    for key in ("input", "output"):
        if not isinstance(item[key], str):
            return f"'{key}' must be a string, got {type(item[key]).__name__}"
    return None


def _test_problem(item: Any, index: int) -> str | None:
    if isinstance(item, dict):
        problem = stdio_problem(item)
        return f"test {index}: {problem}" if problem else None
    if not isinstance(item, str):
        return (f"test {index}: expected a string (assert snippet) or an "
                f"{{'input': str, 'output': str}} object, got {type(item).__name__}")
    try:
        compile(item, f"<test {index}>", "exec")
    except (SyntaxError, ValueError) as exc:
        return f"test {index} does not compile: {exc}: {item[:200]!r}"
    return None


def check_tests(value: Any) -> str | None:
    """An assert string, or a non-empty list of assert strings and/or stdin/stdout objects
    ``{"input": str, "output": str}``; each snippet must compile, a dict of any other shape is
    an error (the formats ``posttrain.sandbox.tests`` judges, docs/sandbox.md)."""
    if isinstance(value, str):
        if not value.strip():
            return "expected a non-empty test string"
        try:
            compile(value, "<tests>", "exec")
        except (SyntaxError, ValueError) as exc:
            return f"the tests do not compile: {exc}"
        return None
    if not isinstance(value, list) or not value:
        return ("expected an assert string or a non-empty list of assert strings / "
                f"{{'input': str, 'output': str}} objects, got {type(value).__name__}")
    return next((p for i, item in enumerate(value) if (p := _test_problem(item, i))), None)


def check_test_imports(value: Any) -> str | None:
    """MBPP's ``test_imports``: import lines put before every assert test by the code reward."""
    if isinstance(value, list) and all(_is_str(line) for line in value):
        return None
    return f"expected a list of import lines (strings), got {_type_name(value)}"


# kind -> (required fields, optional fields); each field has its check.
SCHEMAS: dict[str, tuple[dict[str, Check], dict[str, Check]]] = {
    "prompts": ({"prompt": check_prompt}, {"answer": check_answer, "tests": check_tests,
                                          "test_imports": check_test_imports}),
    "sft": ({"prompt": check_prompt, "completion": check_completion}, {}),
    "preferences": (
        {"chosen": check_completion, "rejected": check_completion}, {"prompt": check_prompt}),
    "steps": ({"prompt": check_prompt, "steps": check_steps, "labels": check_labels}, {}),
    "code": ({"prompt": check_prompt, "tests": check_tests},
             {"test_imports": check_test_imports}),
    "outcomes": ({"prompt": check_prompt, "completion": check_str, "label": check_binary}, {}),
    "unpaired": ({"prompt": check_prompt, "completion": check_completion, "label": check_binary},
                 {}),
}


def schema(kind: str) -> tuple[dict[str, Check], dict[str, Check]]:
    if kind not in SCHEMAS:
        raise ValueError(f"unknown dataset kind {kind!r}; valid: {sorted(SCHEMAS)}")
    return SCHEMAS[kind]


def row_problems(row: Any, kind: str) -> list[tuple[str, str]]:
    """Every ``(field, problem)`` of one row; empty when the row is valid."""
    required, optional = schema(kind)
    if not isinstance(row, dict):
        return [("<row>", f"expected a JSON object, got {_type_name(row)}")]
    if kind == "sft" and "messages" in row and "prompt" not in row:  # TRL's conversational SFT
        return [p] if (p := sft_messages_problem(row)) else []
    if kind == "unpaired" and "completion" not in row and {"chosen", "rejected"} <= set(row):
        return [("completion", "missing: these are preference pairs (chosen / rejected), not "
                               "KTO's unpaired rows: use `posttrain dpo`, or unpair them into "
                               "{prompt, completion, label} rows")]
    problems = []
    for field, check in required.items():
        if field not in row:
            alt = " or ['messages']" if kind == "sft" else ""
            problems.append((field, "missing (required for kind "
                                    f"'{kind}': {sorted(required)}{alt})"))
        elif (msg := check(row[field])) is not None:
            problems.append((field, msg))
    for field, check in optional.items():
        if field in row and (msg := check(row[field])) is not None:
            problems.append((field, msg))
    if kind == "steps" and not problems and len(row["steps"]) != len(row["labels"]):
        problems.append(("labels", f"expected one label per step ({len(row['steps'])}), "
                                   f"got {len(row['labels'])}"))
    if kind == "preferences" and not problems and (p := preference_problem(row)):
        problems.append(p)
    return problems


def normalize_row(row: dict, kind: str) -> dict:
    """Copy of a valid row with numeric answers as strings; conversational SFT ``messages`` and
    preference rows split into prompt + completion (:mod:`posttrain.data.conversations`)."""
    out = dict(row)
    if kind == "sft" and "messages" in out and "prompt" not in out:
        return split_messages(out)
    if kind == "preferences":
        return split_preference(out)
    if kind == "prompts" and "answer" in out and not isinstance(out["answer"], str):
        answer = out["answer"]
        out["answer"] = str(int(answer)) if isinstance(answer, float) and answer.is_integer() \
            else str(answer)
    return out
