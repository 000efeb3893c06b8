"""Turn a dataset prompt (a string or a list of chat messages) into model input text.

The `chat_template` rule (config key, docs/trainers.md "Data formats"):

* ``auto`` (default): when the tokenizer has a chat template, a string prompt is wrapped as one
  user message and rendered with it, and conversational rows are rendered with it; without
  one, string prompts go in as they are and a conversational row is an error.
* ``none``: never apply a template; strings go in as they are, a conversational row is an error.
* any other string: a Jinja template used instead of the tokenizer's (as ``auto`` otherwise).

A string prompt that already starts with the template's opening text or the BOS token (a prompt
rendered with the chat template beforehand, as TRL's older examples did) is used as it is, not
wrapped a second time; the first such prompt is reported once on stderr.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

Prompt = str | list[dict[str, Any]]
TEMPLATE_MODES = ("auto", "none")


class TemplateError(ValueError):
    """A conversational value that cannot be rendered (no template, or a template that does not
    render the prompt as a prefix of the conversation); `row` (0-based) and `field` when known."""

    def __init__(self, message: str, row: int | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.row, self.field = row, field


def as_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """A str prompt becomes one user message; a message list is returned as is."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def uses_template(tokenizer: Any, template: str = "auto") -> bool:
    """Whether rendering applies a chat template under `template` (see the module rule)."""
    if template == "none":
        return False
    return template != "auto" or bool(getattr(tokenizer, "chat_template", None))


def no_template_reason(template: str) -> str:
    """Why a conversational value cannot be rendered, and what to do, in one line."""
    if template == "none":
        return ("chat messages need a chat template, and chat_template: none applies none; "
                "set chat_template: auto (the tokenizer's) or a Jinja template, or give strings")
    return ("chat messages need a chat template and the tokenizer has none; set chat_template "
            "to a Jinja template string, or give plain strings (roles are never dropped silently)")


def _apply(tokenizer: Any, messages: list[dict[str, Any]], template: str,
           generation_prompt: bool, continue_final: bool = False) -> str:
    """The template's text; `continue_final`: a final assistant message (a prefill:
    `<think>`, a JSON opener) is continued, open, with no generation prompt (TRL's
    `continue_final_message`)."""
    extra = {} if template in TEMPLATE_MODES else {"chat_template": template}
    if continue_final and messages and messages[-1].get("role") == "assistant":
        extra["continue_final_message"], generation_prompt = True, False
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt, **extra)


def render_prompt(tokenizer: Any, prompt: Prompt, template: str = "auto",
                  continue_final: bool = True) -> str:
    """The text the model continues: the chat template with the generation prompt added (a
    prompt ending with an assistant message, with `continue_final`: that message continued,
    open), or the string itself where no template applies (`chat_template: none`).

    Tokenize the result with ``add_special_tokens=False``: the template already holds any BOS.
    A message list where no template applies raises :class:`TemplateError`.
    """
    if uses_template(tokenizer, template):
        if isinstance(prompt, str) and already_rendered(tokenizer, prompt, template):
            return prompt
        return _apply(tokenizer, as_messages(prompt), template, True, continue_final)
    if isinstance(prompt, str):
        return prompt
    raise TemplateError(no_template_reason(template))


def render_completion(tokenizer: Any, prompt: Prompt, completion: Prompt,
                      template: str = "auto") -> tuple[str, str]:
    """(prompt text, completion text). A string completion follows the rendered prompt as is
    (continuing a final assistant message); a message-list completion is a new turn: what
    the template renders for the whole conversation after the prompt's own rendering (closed,
    with its generation prompt; an SFT `messages` row's earlier assistant turns)."""
    prompt_text = render_prompt(tokenizer, prompt, template, isinstance(completion, str))
    if isinstance(completion, str):
        return prompt_text, completion
    if not uses_template(tokenizer, template):
        raise TemplateError(no_template_reason(template))
    full = _apply(tokenizer, as_messages(prompt) + list(completion), template, False)
    if not full.startswith(prompt_text):
        raise TemplateError("the chat template does not render the prompt (with its generation "
                            "prompt) as the start of the whole conversation, so the completion "
                            "cannot be cut from it; use a template that does")
    return prompt_text, full[len(prompt_text):]


def tokenize_completions(tokenizer: Any, rows: list[dict[str, Any]], field: str,
                         template: str = "auto") -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each row's rendered ``prompt`` and of its ``row[field]`` completion ending
    at exactly one turn end (`closed_ids`; both without special tokens added). A row that
    cannot be rendered raises TemplateError with its `row` and `field`."""
    texts = []
    for i, r in enumerate(rows):
        try:
            texts.append(render_completion(tokenizer, r["prompt"], r[field], template))
        except TemplateError as err:
            raise TemplateError(str(err), row=i, field=field) from err
    p_ids = tokenizer([p for p, _ in texts], add_special_tokens=False)["input_ids"]
    c_ids = closed_ids(tokenizer, [""] * len(rows), [c for _, c in texts],
                       [isinstance(r[field], list) for r in rows], template)
    return [list(p) for p in p_ids], c_ids


def closed_ids(tokenizer: Any, heads: list[str], tails: list[str], rendered: list[bool],
               template: str = "auto") -> list[list[int]]:
    """Token ids of each ``head + tail`` ending at exactly one turn end. A `rendered` tail (the
    chat template's) that ends with one of the tokenizer's special tokens keeps it and loses the
    whitespace after it (Qwen's and Gemma's newline after the end-of-turn: never sampled, since
    sampling stops at the end token); gpt-oss's ``<|call|>`` closes a turn too. Any other tail
    gets `turn_end_id` appended unless it already ends with it (`close_turn`)."""
    end = turn_end_id(tokenizer, template)
    closers = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | {end}
    bare = [t.rstrip() if r else t for t, r in zip(tails, rendered, strict=True)]
    ids = tokenizer([h + t for h, t in zip(heads, bare, strict=True)],
                    add_special_tokens=False)["input_ids"]
    out = []
    for i, x in enumerate(ids):
        if rendered[i] and x and x[-1] in closers:
            out.append(list(x))
            continue
        if tails[i] != bare[i]:  # not closed by a special token: the text as rendered
            x = tokenizer(heads[i] + tails[i], add_special_tokens=False)["input_ids"]
        out.append(close_turn(list(x), end))
    return out


def close_turn(ids: list[int], end: int | None) -> list[int]:
    """`ids` with `end` appended unless they already end with it (or `end` is None)."""
    return ids if end is None or ids[-1:] == [end] else [*ids, end]


def turn_end_id(tokenizer: Any, template: str = "auto") -> int | None:
    """The id that ends an assistant turn: the added token the chat template closes an
    assistant message with (Qwen's ``<|im_end|>``, Gemma's ``<end_of_turn>``, gpt-oss's
    ``<|return|>``), else the tokenizer's EOS (no template, or one that closes with text).
    Not cached: a tokenizer's template may change, and one render is cheap."""
    found = _closing_token(tokenizer, template)
    return found if found is not None else tokenizer.eos_token_id


def _closing_token(tokenizer: Any, template: str) -> int | None:
    """The added token that starts what the template writes after an assistant message's
    content, or None (no template, a template that fails on the probe, or a text close)."""
    if not uses_template(tokenizer, template):
        return None
    probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = _apply(tokenizer, probe, template, False)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: EOS as before
        return None
    if _PROBE not in text:
        return None
    tail = tokenizer(text.rsplit(_PROBE, 1)[1], add_special_tokens=False)["input_ids"]
    if not tail:
        return None
    added = set(tokenizer.get_added_vocab().values())
    return int(tail[0]) if tail[0] in added else None


_PROBE = "\x00posttrain-probe\x00"
# per tokenizer object, dropped with it (an id() key could be reused by a later tokenizer)
_openings: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
_reported: list[bool] = [False]


def already_rendered(tokenizer: Any, text: str, template: str = "auto") -> bool:
    """Whether `text` already starts with what the chat template puts before a user message
    (its BOS, system block and user header), or with the BOS token; said once on stderr."""
    known = _openings.setdefault(tokenizer, {})
    if template not in known:
        probe = _apply(tokenizer, as_messages(_PROBE), template, True)
        known[template] = probe.split(_PROBE)[0] if _PROBE in probe else ""
    opening = known[template]
    bos = getattr(tokenizer, "bos_token", None) or ""
    found = next((o for o in (opening, bos) if o.strip() and text.startswith(o)), None)
    if found is not None and not _reported[0]:
        _reported[0] = True
        print(f"posttrain: note: a prompt already starts with the chat template's opening "
              f"{found[:40]!r}; prompts rendered beforehand are used as they are, not wrapped "
              "again (chat_template: none turns the template off for every prompt)",
              file=sys.stderr)
    return found is not None
