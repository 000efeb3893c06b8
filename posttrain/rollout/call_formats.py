"""Tool-call formats of the model families: how a turn's calls are read and how their answers
are rendered, as each family's chat template writes them (docs/agents.md, "Model families").

- Formats (vLLM's parser names): `hermes` `<tool_call>{json}</tool_call>` (Qwen3, the
  fallback), `llama3_json` `{"name": ..., "parameters": {...}}`, `openai` (gpt-oss harmony),
  `deepseek_v3` (`<｜tool▁call▁begin｜>`...), `response_template` (`parse_response`).
- `tool_call_parser: auto` reads the format off the tokenizer: its response template, else the
  markers its chat template writes; a template that renders tools in no format read here is
  refused in one line naming what it saw. The turn is parsed from its text decoded WITH its
  special tokens (harmony and DeepSeek's markers are special tokens).
- An answer is the text the chat template writes after the assistant's turn when the tool
  messages and the next generation prompt follow it (the assistant message carries its call,
  as gpt-oss needs); a template without a tool role (Gemma 3) gets them as one user message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["FORMATS", "answer_text", "check_call_format", "detect_format", "raw_calls"]

_MARK = "posttrainQ7mark"
_SPECIAL_MARKS = (  # (marker in the chat template, format or None (not read here), its name)
    ("<｜tool▁call▁begin｜>", "deepseek_v3", ""),
    ("<|call|>", "openai", ""),
    ("<|python_tag|>", "llama3_json", ""),
    ("<arg_key>", None, "GLM's <tool_call> with <arg_key>/<arg_value> XML arguments"),
    ("<function=", None, "XML calls <function=NAME><parameter=...> (Qwen3-Coder)"),
    ("[TOOL_CALLS]", None, "Mistral's [TOOL_CALLS]"),
    ("<|tool_calls_section_begin|>", None, "Kimi K2's <|tool_calls_section_begin|>"),
    ("<start_function_call>", None, "FunctionGemma's <start_function_call>"),
    ("<tool_call>", "hermes", ""),
)
DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")


def _hermes(text: str) -> list[Any] | str:
    calls, at = [], 0
    while (i := text.find("<tool_call>", at)) >= 0:  # linear: no regex backtracking
        j = text.find("</tool_call>", i)
        if j < 0:
            break
        try:
            calls.append(json.loads(text[i + len("<tool_call>"):j]))
        except (ValueError, RecursionError) as err:  # a number > 4300 digits, deep nesting
            return f"the tool call is not valid JSON: {err}"
        at = j + len("</tool_call>")
    if not calls and "<tool_call>" in text:
        return "the tool call has no closing </tool_call>"
    return calls


def _llama3_json(text: str) -> list[Any] | str:
    """`{"name": ..., "parameters": {...}}` (several joined by `;`), alone or after
    `<|python_tag|>`; a turn that does not start with one is an answer."""
    body = text.strip()
    for end in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"):
        body = body.removesuffix(end).rstrip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    elif not (body.startswith("{") and '"name"' in body):
        return []
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError) as err:
            return f"the tool call is not valid JSON: {err}"
        calls.append({"name": obj.get("name"), "arguments": obj.get(
            "parameters", obj.get("arguments"))} if isinstance(obj, dict) else obj)
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return calls


def _harmony(text: str) -> list[Any] | str:
    """gpt-oss: each assistant message whose header holds `to=functions.NAME` (before or after
    its channel) is a call; its body, `<|message|>` to `<|call|>`, the JSON arguments. The
    turn's first message is the assistant's (its `<|start|>assistant` was the prompt's)."""
    calls = []
    for k, msg in enumerate(text.split("<|start|>")):
        header, sep, body = msg.partition("<|message|>")
        if "to=" not in header or (k and not header.startswith("assistant")):
            continue  # not a call, or a tool's answer (`functions.NAME to=assistant`)
        name = (header.split("to=", 1)[1].replace("<|", " ").split() or [""])[0]
        if not sep:
            return f"the tool call to {name!r} has no <|message|>"
        for end in ("<|call|>", "<|end|>", "<|return|>"):
            body = body.split(end, 1)[0]
        try:
            args = json.loads(body)
        except (ValueError, RecursionError) as err:
            return f"the tool call's arguments are not valid JSON: {err}"
        calls.append({"name": name.removeprefix("functions."), "arguments": args})
    return calls


def _deepseek_v3(text: str) -> list[Any] | str:
    """`<｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`."""
    if DS[0] not in text and DS[1] not in text:
        return []
    calls, at = [], 0
    while (i := text.find(DS[1], at)) >= 0:
        j = text.find(DS[3], i)
        if j < 0:
            return "the tool call has no closing <｜tool▁call▁end｜>"
        _, sep, rest = text[i + len(DS[1]):j].partition(DS[2])
        name, _, args = rest.partition("\n")
        args = args.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
        if not sep:
            return "the tool call has no <｜tool▁sep｜> before its name"
        try:
            calls.append({"name": name.strip(), "arguments": json.loads(args)})
        except (ValueError, RecursionError) as err:
            return f"the tool call's arguments are not valid JSON: {err}"
        at = j + len(DS[3])
    return calls or "<｜tool▁calls▁begin｜> without a <｜tool▁call▁begin｜>"


def _response_template(tokenizer: Any, text: str) -> list[Any] | str:
    import inspect

    takes_prefix = "prefix" in inspect.signature(tokenizer.parse_response).parameters
    out = (tokenizer.parse_response(text, prefix="") if takes_prefix
           else tokenizer.parse_response(text))
    raw = out.get("tool_calls") or []
    return [c.get("function", c) if isinstance(c, dict) else c for c in raw]


FORMATS: dict[str, Callable[[str], list[Any] | str]] = {
    "hermes": _hermes, "llama3_json": _llama3_json, "openai": _harmony,
    "deepseek_v3": _deepseek_v3}
"""Format -> parser of a turn's text (special tokens kept): raw calls or an error message."""


def raw_calls(tokenizer: Any, fmt: str, text: str) -> list[Any] | str:
    """The calls of `text` in format `fmt` (`FORMATS` or `response_template`), unchecked."""
    if fmt == "response_template":
        return _response_template(tokenizer, text)
    return FORMATS[fmt](text)


def detect_format(tokenizer: Any, key: str = "auto") -> str:
    """The call format of `tokenizer` (config key `tool_call_parser`; `auto`: its response
    template, else the markers its chat template writes, else `hermes` when the template
    renders no tools). A template that renders tools in a format not read here is refused."""
    valid = ("auto", "response_template", *FORMATS)
    if key not in valid:
        raise ValueError(f"config key 'tool_call_parser': {key!r}; expected one of {valid}")
    if key != "auto":
        return key
    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema",
                                                                 None):
        return "response_template"
    template = tokenizer.chat_template or ""
    template = template if isinstance(template, str) else json.dumps(template)
    for marker, fmt, name in _SPECIAL_MARKS:
        if marker in template:
            if fmt is None:
                raise ValueError(f"config key 'tool_call_parser': the chat template writes tool "
                                 f"calls as {name} ({marker!r}), a format posttrain does not "
                                 f"read; set tool_call_parser to one of {list(FORMATS)} if the "
                                 "model writes one of them")
            return fmt
    if "tools" in template:
        known = [m for m, f, _ in _SPECIAL_MARKS if f]
        raise ValueError("config key 'tool_call_parser': the chat template renders tools but "
                         f"writes none of the call markers read here ({known}); set "
                         f"tool_call_parser to the one the model writes ({list(FORMATS)})")
    return "hermes"


def _assistant(fmt: str, name: str, structured: bool) -> dict[str, Any]:
    """The assistant message standing for the model's turn (only what follows it is used)."""
    if not structured:
        return {"role": "assistant", "content": _MARK}
    args: Any = json.dumps({"m": _MARK}) if fmt == "deepseek_v3" else {"m": _MARK}
    return {"role": "assistant", "content": None if fmt == "deepseek_v3" else "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}


_FORMS: dict[tuple[str, str], tuple[bool, bool]] = {}
"""(template, format) -> the form that rendered last time (a call or plain content; a tool
role or a user message): tried first."""


def _render(tokenizer: Any, fmt: str, name: str, contents: list[tuple[str, str]]
            ) -> tuple[str, str]:
    """(the conversation ending in the assistant's turn, the same + the answers + the
    generation prompt): the first form the template renders with the assistant's turn in it."""
    key = (str(tokenizer.chat_template), fmt)
    forms = [(True, False), (True, True), (False, False), (False, True)]
    why = "it drops the assistant's message"
    for structured, as_user in sorted(forms, key=lambda f: f != _FORMS.get(key)):
        head = [{"role": "user", "content": "q"}, _assistant(fmt, name, structured)]
        answers = ([{"role": "user", "content": "\n".join(c for _, c in contents)}] if as_user
                   else [{"role": "tool", "name": n, "content": c} for n, c in contents])
        try:
            r1 = tokenizer.apply_chat_template(head, tokenize=False)
            if _MARK not in r1:
                continue
            r2 = tokenizer.apply_chat_template(head + answers, tokenize=False,
                                               add_generation_prompt=True)
        except Exception as err:  # the template's own raise_exception
            why = f"{type(err).__name__}: {err}"
            continue
        if _MARK in r2:
            _FORMS[key] = (structured, as_user)
            return r1, r2
    raise ValueError(f"the chat template cannot render a tool answer after an assistant turn "
                     f"({why}); tool answers cannot be appended as tokens")


def _contents(tokenizer: Any, results: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each answer, wrapped as `<tool_response>...</tool_response>` for a template that knows
    no tools (the fallback format's answers)."""
    wrap = "tool" not in (tokenizer.chat_template or "")
    return [(n, f"<tool_response>{c}</tool_response>" if wrap else c) for n, c in results]


def answer_text(tokenizer: Any, fmt: str, name: str, results: list[tuple[str, str]],
                stop_text: str) -> str:
    """The text that follows a model turn ending in `stop_text` (the call to `name`) and
    answers it with `results` [(tool name, content)]: what the chat template writes after the
    assistant's turn, without what the model sampled (its end-of-turn). No template: each
    answer as a `<tool_response>` line."""
    contents = _contents(tokenizer, results)
    if not tokenizer.chat_template:
        return "".join(c + "\n" for _, c in contents)
    r1, r2 = _render(tokenizer, fmt, name, contents)
    a, b = r1[r1.index(_MARK) + len(_MARK):], r2[r2.index(_MARK) + len(_MARK):]
    n = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
             min(len(a), len(b)))  # the turn's close, as the template writes it
    end = b[:n].find(stop_text) if stop_text else -1
    return b[end + len(stop_text):] if end >= 0 else b[n:]


def check_call_format(tokenizer: Any, key: str = "auto") -> str:
    """The run's call format (`detect_format`), checked before any model loads: the template
    renders an answer after a call, and that answer's tokens are the template's own (the same
    ids alone as at the end of the whole conversation)."""
    fmt = detect_format(tokenizer, key)
    if not (tokenizer.chat_template or ""):
        return fmt
    tail = answer_text(tokenizer, fmt, "probe", [("probe", "42")], "")
    _, whole = _render(tokenizer, fmt, "probe", _contents(tokenizer, [("probe", "42")]))
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    own = tokenizer(tail, add_special_tokens=False)["input_ids"]
    if not own or ids[-len(own):] != own:
        raise ValueError(f"config key 'tool_call_parser' ({fmt}): a tool answer tokenized alone "
                         "is not the ids the chat template's whole conversation ends with, so "
                         "appended answers would not be the template's tokens")
    return fmt
