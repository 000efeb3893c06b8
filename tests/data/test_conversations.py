"""Conversational rows (TRL's formats) and the chat-template rule of rendering."""

from __future__ import annotations

import json

import pytest

from posttrain.data import DataError, load_rows
from posttrain.data.prompts import (
    TemplateError,
    render_completion,
    render_prompt,
    tokenize_completions,
)
from posttrain.tasks.tokenizer import build_char_tokenizer

U = {"role": "user", "content": "1+2"}
S = {"role": "system", "content": "s"}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write(tmp_path, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_messages_train_on_the_last_assistant_turn(tmp_path):
    row = {"messages": [S, U, A("3"), {"role": "user", "content": "+1"}, A("4")], "id": 7}
    (out,) = load_rows(write(tmp_path, [row]), "sft")
    assert out == {"id": 7, "prompt": row["messages"][:4], "completion": [A("4")]}


def test_conversational_prompt_completion_and_preferences(tmp_path):
    sft = {"prompt": [U], "completion": [A("3")]}
    assert load_rows(write(tmp_path, [sft]), "sft") == [sft]
    # UltraFeedback: a prompt string and each side the whole conversation
    uf = {"prompt": "1+2", "chosen": [U, A("3")], "rejected": [U, A("4")]}
    assert load_rows(write(tmp_path, [uf]), "preferences") == [
        {"prompt": [U], "chosen": [A("3")], "rejected": [A("4")]}]
    implicit = {"chosen": [U, A("3")], "rejected": [U, A("4")]}
    assert load_rows(write(tmp_path, [implicit]), "preferences")[0]["prompt"] == [U]
    explicit = {"prompt": [U], "chosen": [A("3")], "rejected": [A("4")]}
    assert load_rows(write(tmp_path, [explicit]), "preferences") == [explicit]


BAD = [
    ("sft", {"messages": [U]}, "messages", "assistant message"),
    ("sft", {"messages": [A("3")]}, "messages", "before the last"),
    ("sft", {"messages": [{"role": "user"}, A("3")]}, "messages", "'content'"),
    ("sft", {"prompt": [U], "completion": [{"role": 1, "content": "3"}]}, "completion", "role"),
    ("preferences", {"prompt": "p", "chosen": [A("3")], "rejected": "4"}, "rejected",
     "same type"),
    ("preferences", {"chosen": [A("3")], "rejected": [A("4")]}, "prompt", "share no leading"),
    ("preferences", {"chosen": "3", "rejected": "4"}, "prompt", "missing"),
    ("preferences", {"prompt": "other", "chosen": [U, A("3")], "rejected": [U, A("4")]},
     "prompt", "differs"),
    ("preferences", {"chosen": [U, A("3")], "rejected": [U, A("3")]}, "rejected", "differ"),
]


@pytest.mark.parametrize(("kind", "row", "field", "words"), BAD)
def test_bad_conversational_row_names_file_line_field(tmp_path, kind, row, field, words):
    good = {"sft": {"messages": [U, A("3")]},
            "preferences": {"chosen": [U, A("3")], "rejected": [U, A("4")]}}[kind]
    path = write(tmp_path, [good, row])
    with pytest.raises(DataError) as info:
        load_rows(path, kind)
    assert (info.value.source, info.value.line, info.value.field) == (str(path), 2, field)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_render_through_the_chat_template():
    tok = build_char_tokenizer()  # user: content + "\n"; assistant: content + "</s>"
    assert render_completion(tok, [U], [A("3")]) == ("<s>1+2\n", "3</s>")
    assert render_completion(tok, "1+2", "3") == ("<s>1+2\n", "3")  # a string follows as is
    prompts, completions = tokenize_completions(tok, [{"prompt": [U], "c": [A("3")]},
                                                      {"prompt": "1+2", "c": "3"}], "c")
    eos = tok.eos_token_id
    assert completions[0] == completions[1] and completions[0].count(eos) == 1  # no second EOS
    assert prompts[0] == prompts[1]


def test_chat_template_modes():
    tok = build_char_tokenizer()
    assert render_prompt(tok, "1+2", "none") == "1+2"
    with pytest.raises(TemplateError, match="chat_template: none"):
        render_prompt(tok, [U], "none")
    custom = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    assert render_prompt(tok, [S, U], custom) == "[system]s[user]1+2"
    tok.chat_template = None  # a base model's tokenizer: strings as they are, roles never dropped
    assert render_prompt(tok, "1+2") == "1+2"
    with pytest.raises(TemplateError, match="has none"):
        render_prompt(tok, [S, U])
    assert render_prompt(tok, [S, U], custom) == "[system]s[user]1+2"


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_an_assistant_prefill_is_continued_not_closed():
    """Issue 57 item 2: a prompt ending with an assistant message (`<think>`, a JSON opener) is
    that message left open for the model to continue (TRL's `continue_final_message`), with no
    generation prompt after a closed turn; other prompts get the generation prompt."""
    tok = build_char_tokenizer()
    user = "<|im_start|>user\n1+2<|im_end|>\n"
    assert render_prompt(tok, [U, A("<think>")], CHATML) == user + "<|im_start|>assistant\n<think>"
    assert render_prompt(tok, [U], CHATML) == user + "<|im_start|>assistant\n"
    # a whole conversation (SFT's completion) still renders its final turn closed
    assert render_completion(tok, [U], [A("3")], CHATML)[1] == "3<|im_end|>\n"
    # a string completion continues the prefill; a message completion after an earlier
    # (closed) assistant turn, as an SFT `messages` row splits, is a new turn
    assert render_completion(tok, [U, A("<think>")], "2+1</think>", CHATML) == (
        user + "<|im_start|>assistant\n<think>", "2+1</think>")
    two = user + "<|im_start|>assistant\n3<|im_end|>\n<|im_start|>assistant\n"
    assert render_completion(tok, [U, A("3")], [A("4")], CHATML) == (two, "4<|im_end|>\n")
