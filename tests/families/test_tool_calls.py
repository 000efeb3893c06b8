"""Tool calls in each family's own format, with the real tokenizers and chat templates: a
scripted turn (the model's output is fixed ids: the family's native call, tokenized) is parsed
and run, and the ids appended after it are those the template's rendering of the whole
conversation ends with; formats posttrain cannot read are refused in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.rollout.call_formats import DS, FORMATS, check_call_format, detect_format
from posttrain.rollout.episodes import AgentSampler, takes_tools
from posttrain.rollout.hf import SamplingParams
from posttrain.rollout.tools import AgentSpec, ToolCall, parse_tool_calls


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)


FORMAT = {"qwen3": "hermes", "llama3_1": "llama3_json", "gemma3": "hermes",
          "gptoss": "openai", "deepseek_v3": "deepseek_v3"}
# what each family's model writes for add(a=2, b=3), as its template writes the call (Gemma 3's
# template has no call format: the fallback), through its end-of-turn / call token
NATIVE = {
    "qwen3": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
    "llama3_1": '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
    "gemma3": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><end_of_turn>',
    "gptoss": ' to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
                   '{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
                   "<｜end▁of▁sentence｜>",
}
OTHER_FORMS = {  # the same call in the family's other documented form
    "llama3_1": '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}<|eom_id|>',
    "gptoss": '<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>'
              'commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>'
              '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"5"<|end|>',
}  # (gpt-oss: a tool's answer after the call, `functions.add to=assistant`, is no call)
# the text each template writes after the assistant's call for the answer "5" and the next
# generation prompt (by hand, from the templates; checked against their rendering below)
ANSWER = {
    "qwen3": "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n",
    "llama3_1": '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma3": "\n<start_of_turn>user\n<tool_response>5</tool_response><end_of_turn>\n"
              "<start_of_turn>model\n",
    "gptoss": '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"5"<|end|>'
              "<|start|>assistant",
    "deepseek_v3": "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>5<｜tool▁output▁end｜>"
                   "<｜tool▁outputs▁end｜>",
}
BAD = {  # a malformed call in each format
    "hermes": '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 2,<|eot_id|>',
    "openai": " to=functions.add<|channel|>commentary json<|message|>{\"a\": <|call|>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
                   "{oops\n```<｜tool▁call▁end｜>",
}


def ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class Scripted:
    """An inner sampler whose every episode writes the scripted turns in order."""

    name, runs_policy = "scripted", False

    def __init__(self, tokenizer: Any, turns: list[list[int]], stops: list[int]) -> None:
        self.tokenizer, self.turns, self.stops, self.seen = tokenizer, turns, stops, []

    def sample_ids(self, contexts: list[list[int]], params: Any, stops: list[int],
                   **_: Any) -> list[Any]:
        self.seen.append([list(c) for c in contexts])
        turn = self.turns[len(self.seen) - 1]
        return [SimpleNamespace(token_ids=list(turn), logprobs=None, finish_reason="stop")
                for _ in contexts]

    def end_turns(self) -> None:
        pass


def conversation(tok: Any, family: str, answer: bool) -> str:
    """The template's rendering of user -> the assistant's call -> (the tool's answer and the
    generation prompt). DeepSeek V3's template renders a call only for `content: None`, which
    transformers 5 drops before rendering: its call is a plain assistant message there."""
    msgs = [{"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    if answer:
        msgs.append({"role": "user", "content": "<tool_response>5</tool_response>"}
                    if family == "gemma3" else {"role": "tool", "name": "add", "content": "5"})
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=answer)


def test_the_native_call_is_the_templates_own(family, family_tokenizer):
    """The scripted calls are what each template writes for an assistant's call (Gemma 3's
    template writes none), and the call format is read off the template."""
    tok = family_tokenizer
    assert check_call_format(tok) == FORMAT[family]
    if family == "deepseek_v3":  # its call branch is unreachable (above): read the template
        for piece in ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type']",
                      "'<｜tool▁sep｜>' + tool['function']['name']", "'```json'",
                      "tool['function']['arguments']", "<｜tool▁call▁end｜>"):
            assert piece in tok.chat_template
    elif family != "gemma3":
        call = NATIVE[family].removesuffix("<｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
        for end in ("<|im_end|>", "<|eot_id|>"):
            call = call.removesuffix(end)
        assert call in conversation(tok, family, False)
    assert conversation(tok, family, True).endswith(ANSWER[family])


def test_a_scripted_call_runs_and_its_answer_is_the_templates_tokens(family, family_tokenizer):
    tok = family_tokenizer
    stop = ids(tok, NATIVE[family])[-1]
    final = ids(tok, "It is 5.") + [stop]
    inner = Scripted(tok, [ids(tok, NATIVE[family]), final], [stop])
    show = "template" if takes_tools(tok) else "none"
    eng = AgentSampler(inner, AgentSpec({"add": add}, None, 2, 5.0), tool_schemas=show)
    r = eng.generate(rows=[{"prompt": "2+3?"}], params=SamplingParams(512, greedy=True))
    ep = r.episodes[0]
    assert (ep["calls"], ep["errors"], ep["turns"], ep["cut"]) == (1, {}, 2, None)
    assert [m["content"] for m in r.rows[0]["messages"] if m["role"] == "tool"] == ["5"]
    prompt = inner.seen[0][0]
    appended = inner.seen[1][0][len(prompt) + len(ids(tok, NATIVE[family])):]
    assert appended == ids(tok, ANSWER[family])  # the template's text, token for token
    whole = ids(tok, conversation(tok, family, True))
    assert whole[-len(appended):] == appended  # the ids the whole conversation ends with
    mask = r.response_mask[0].tolist()
    n_call = len(ids(tok, NATIVE[family]))
    assert mask[:n_call + len(appended) + len(final)] == (
        [True] * n_call + [False] * len(appended) + [True] * len(final))


@pytest.mark.parametrize("name", sorted(OTHER_FORMS))
def test_the_other_documented_forms_parse(name, family_builder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_builder(name))
    text = tok.decode(ids(tok, OTHER_FORMS[name]))
    calls = parse_tool_calls(tok, text, FORMAT[name])
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("fmt", sorted(BAD))
def test_a_malformed_call_is_a_message_in_every_format(fmt):
    got = parse_tool_calls(None, BAD[fmt], fmt)
    assert isinstance(got, str) and got, got


def test_answers_in_every_format_are_not_calls():
    for fmt in FORMATS:
        assert parse_tool_calls(None, "It is 5.<|im_end|>", fmt) == [], fmt
    assert parse_tool_calls(None, "<|channel|>final<|message|>5<|return|>", "openai") == []


@settings(max_examples=120, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.one_of(st.text(max_size=20), st.sampled_from([
    "<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", '"name"', ";", "<|start|>",
    "to=", "to=functions.", "<|message|>", "<|call|>", "<|channel|>", *DS,
    "\n```json\n", "[" * 1500, "9" * 4400])), max_size=8))
def test_fuzz_every_parser_returns_calls_or_a_message(parts):
    text = "".join(parts)
    for fmt in FORMATS:
        got = parse_tool_calls(None, text, fmt)
        assert isinstance(got, str) or all(isinstance(c, ToolCall) for c in got)


def test_formats_not_read_here_are_refused_in_one_line():
    for template, named in (("{{ '[TOOL_CALLS]' }}{{ tools }}", "Mistral"),
                            ("{% for t in tools %}{{ t }}{% endfor %}", "none of the call")):
        tok = SimpleNamespace(chat_template=template)
        with pytest.raises(ValueError, match=named) as err:
            detect_format(tok)
        assert "\n" not in str(err.value) and "tool_call_parser" in str(err.value)
    assert detect_format(SimpleNamespace(chat_template="{{ x }}")) == "hermes"  # no tools
    assert detect_format(SimpleNamespace(chat_template="[TOOL_CALLS] tools"), "hermes") == (
        "hermes")  # named by the user: taken as said
    with pytest.raises(ValueError, match="expected one of"):
        detect_format(SimpleNamespace(chat_template=""), "mistral")


def test_a_response_template_is_preferred_and_read():
    class Tok:
        chat_template = "{{ '<tool_call>' }}"
        response_template = {"x": 1}

        def parse_response(self, text: str, schema: Any = None, *, prefix: Any = None) -> dict:
            assert prefix == ""
            return {"tool_calls": [{"type": "function", "function": {
                "name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}]}

    assert detect_format(Tok()) == "response_template"
    calls = parse_tool_calls(Tok(), "anything", "response_template")
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 2, "b": 3})]


def test_a_run_whose_template_writes_an_unread_format_is_refused_before_the_model_loads(
        family_builder, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from posttrain.config import ConfigError
    from posttrain.engine import session
    from posttrain.trainers.grpo import GRPOTrainer

    path = family_builder("qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = tok.chat_template.replace("<tool_call>", "[TOOL_CALLS]")

    def no_model(*a: Any, **k: Any) -> Any:
        raise AssertionError("the model loaded")

    monkeypatch.setattr(session, "load_model_and_tokenizer", no_model)
    with pytest.raises(ConfigError, match="Mistral's \\[TOOL_CALLS\\]") as err:
        GRPOTrainer(model=str(path), tokenizer=tok, tools=[add], rewards=["math"],
                    train_data=[{"prompt": "2+3?", "answer": "5"}], out_dir=str(tmp_path),
                    report_to=[])
    assert "\n" not in str(err.value) and "tool_call_parser" in str(err.value)


def test_a_real_response_template_is_read_by_transformers_in_an_episode(family_builder):
    """transformers 5's own `parse_response` with a response template on the Qwen3 tokenizer
    (none of the five ships one): `auto` prefers it, the call runs, the answer is the
    template's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_builder("qwen3"))
    tok.response_template = {"start_anchor": "<|im_start|>assistant\n", "fields": {
        "content": {"close": "<|im_end|>"},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json",
                       "repeats": True}}}
    assert detect_format(tok) == "response_template"
    call = ids(tok, NATIVE["qwen3"])
    inner = Scripted(tok, [call, ids(tok, "5<|im_end|>")], call[-1:])
    r = AgentSampler(inner, AgentSpec({"add": add}, None, 2, 5.0)).generate(
        rows=[{"prompt": "2+3?"}], params=SamplingParams(256, greedy=True))
    assert (r.episodes[0]["calls"], r.episodes[0]["errors"]) == (1, {})
    assert inner.seen[1][0][-len(ids(tok, ANSWER["qwen3"])):] == ids(tok, ANSWER["qwen3"])
    bad = parse_tool_calls(tok, BAD["hermes"], "response_template")
    assert isinstance(bad, str) and "could not be parsed" in bad
