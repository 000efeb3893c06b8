import json

import pytest

from posttrain.data import DataError, load_rows, read_jsonl, render_prompt
from posttrain.tasks.tokenizer import build_char_tokenizer


def write(tmp_path, lines, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


GOOD = {
    "prompts": {"prompt": "1+2", "answer": "3", "level": 1},
    "sft": {"prompt": "1+2", "completion": "<answer>3</answer>"},
    "preferences": {"prompt": [{"role": "user", "content": "hi"}], "chosen": "a",
                    "rejected": "b"},
    "steps": {"prompt": "1+2+3", "steps": ["1+2=3", "3+3=6"], "labels": [1, -1]},
    "code": {"prompt": "write f", "tests": ["assert f() == 1"]},
}


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_good_rows_load(tmp_path, kind):
    path = write(tmp_path, [GOOD[kind], "", GOOD[kind]])
    rows = load_rows(path, kind)
    assert rows == [GOOD[kind], GOOD[kind]]


# (kind, bad row, field named in the error, words of the expectation)
BAD = [
    ("prompts", {"answer": "3"}, "prompt", "missing"),
    ("prompts", {"prompt": 5, "answer": "3"}, "prompt", "expected a string or"),
    ("prompts", {"prompt": "", "answer": "3"}, "prompt", "non-empty"),
    ("prompts", {"prompt": [{"role": "user"}]}, "prompt", "'content' to be a string"),
    ("prompts", {"prompt": "1+2", "answer": [3]}, "answer", "expected a string"),
    ("sft", {"prompt": "1+2"}, "completion", "missing"),
    ("sft", {"prompt": "1+2", "completion": None}, "completion", "got null"),
    ("preferences", {"prompt": "p", "chosen": "a"}, "rejected", "missing"),
    ("steps", {"prompt": "p", "steps": ["a"], "labels": [2]}, "labels", "1, 0 or -1"),
    ("steps", {"prompt": "p", "steps": ["a", "b"], "labels": [1]}, "labels", "one label per"),
    ("steps", {"prompt": "p", "steps": "a", "labels": [1]}, "steps", "list of strings"),
    ("code", {"prompt": "p", "tests": [1]}, "tests", "expected a string"),
]


@pytest.mark.parametrize(("kind", "row", "field", "words"), BAD)
def test_bad_row_names_file_line_field(tmp_path, kind, row, field, words):
    path = write(tmp_path, [GOOD[kind], GOOD[kind], row])
    with pytest.raises(DataError) as info:
        load_rows(path, kind)
    err = info.value
    assert (err.source, err.line, err.field) == (str(path), 3, field)
    assert str(err).startswith(f"{path}:3: field '{field}':")
    assert words in str(err)


def test_bad_json_names_line(tmp_path):
    path = write(tmp_path, [GOOD["sft"], '{"prompt": "x", "completion": '])
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid JSON") as info:
        load_rows(path, "sft")
    assert info.value.line == 2


def test_non_object_row(tmp_path):
    path = write(tmp_path, ["[1, 2]"])
    with pytest.raises(DataError, match=r"d\.jsonl:1: expected a JSON object, got list"):
        load_rows(path, "sft")


def test_empty_dataset(tmp_path):
    path = write(tmp_path, [""])
    with pytest.raises(DataError, match="empty"):
        load_rows(path, "prompts")


def test_missing_file_and_unknown_kind(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_rows(tmp_path / "nope.jsonl", "sft")
    with pytest.raises(ValueError, match="valid"):
        load_rows(write(tmp_path, [GOOD["sft"]]), "sfft")


def test_several_problems_reported_together(tmp_path):
    path = write(tmp_path, [{"prompt": "a", "completion": 1}, {"prompt": 2, "completion": "b"},
                            GOOD["sft"]])
    with pytest.raises(DataError) as info:
        load_rows(path, "sft")
    assert info.value.line == 1 and f"{path}:2: field 'prompt'" in str(info.value)


def test_a_missing_field_is_one_line_with_a_columns_hint(tmp_path):
    """GSM8K-style rows without `prompt`: one line (not one per row), naming the fix."""
    path = write(tmp_path, [{"question": f"{i}+1", "answer": "1"} for i in range(20)])
    with pytest.raises(DataError) as info:
        load_rows(path, "prompts")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:1: field 'prompt': missing")
    assert "columns={prompt: question}" in message and "missing from 20 rows" in message


def test_sft_conversations_given_to_rl_are_named_as_sft_rows(tmp_path):
    """Issue 57 item 3: `{"messages": [user, assistant]}` rows for GRPO are said to be SFT rows
    (drop the final assistant message, or `posttrain sft`), never mapped to the prompt whole:
    that would put the reference answer inside the prompt."""
    conv = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
    path = write(tmp_path, [{"messages": conv} for _ in range(4)])
    with pytest.raises(DataError) as info:
        load_rows(path, "prompts")
    message = str(info.value)
    assert "\n" not in message and "columns={prompt: messages}" not in message
    assert "an SFT row" in message and "{prompt: messages[:-1], answer: ...}" in message
    assert "`posttrain sft`" in message and "missing from 4 rows" in message
    # a conversation that ends with the user's turn is a prompt: mapping it is the fix
    path = write(tmp_path, [{"messages": conv[:1]}], "prompts.jsonl")
    with pytest.raises(DataError, match="columns=\\{prompt: messages\\}"):
        load_rows(path, "prompts")


def test_numeric_answer_becomes_string_and_columns_rename(tmp_path):
    path = write(tmp_path, [{"question": "1+2", "answer": 3}, {"question": "1.5+1", "answer": 2.5}])
    rows = load_rows(path, "prompts", columns={"prompt": "question"})
    assert rows == [{"prompt": "1+2", "answer": "3"}, {"prompt": "1.5+1", "answer": "2.5"}]
    bad = write(tmp_path, [{"q": "1+2"}], "bad.jsonl")
    with pytest.raises(DataError, match="column 'question'"):
        load_rows(bad, "prompts", columns={"prompt": "question"})


def test_json_array_file(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD["sft"], GOOD["sft"]]))
    assert len(read_jsonl(path)) == 2
    assert len(load_rows(path, "sft")) == 2


def test_parquet_and_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([GOOD["sft"], {"prompt": "x", "completion": "y"}])
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert load_rows(tmp_path / "d.parquet", "sft")[1] == {"prompt": "x", "completion": "y"}
    ds.save_to_disk(str(tmp_path / "saved"))
    assert len(load_rows(tmp_path / "saved", "sft")) == 2
    bad = datasets.Dataset.from_list([{"prompt": "x", "completion": "y"}, {"prompt": "x",
                                                                            "completion": None}])
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad\.parquet:2: field 'completion'"):
        load_rows(tmp_path / "bad.parquet", "sft")


def test_unreachable_hub_dataset(monkeypatch):
    from posttrain.data import hub

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(DataError, match="Hugging Face Hub is unreachable"):
        load_rows("no-such-org/no-such-dataset-xyz", "prompts")


def test_hub_reachable_is_false_for_a_closed_endpoint(monkeypatch):
    from huggingface_hub import constants

    from posttrain.data import hub

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port, closed
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert hub.hub_reachable(timeout_s=1.0) is False
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.hub_reachable() is False


def test_render_prompt_str_and_messages():
    tok = build_char_tokenizer()
    assert render_prompt(tok, "7*3") == "<s>7*3\n"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "7*3"}]
    assert render_prompt(tok, msgs) == "<s>s\n7*3\n"


def test_data_and_reward_errors_cross_process_pools_intact():
    """A worker's error reaches the parent with its message (pickling needs all fields)."""
    import pickle

    from posttrain.data.loading import DataError
    from posttrain.rewards.errors import RewardFunctionError

    err = DataError("d.jsonl", 3, "answer", "expected a string, got list", ["d.jsonl:4: x"])
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and (back.line, back.field) == (3, "answer")
    err = RewardFunctionError("math", 2, ValueError("bad"), "12+", note="n")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and (back.name, back.index) == ("math", 2)
