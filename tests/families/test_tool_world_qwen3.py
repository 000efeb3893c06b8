"""The tool world on the real Qwen3 tokenizer and chat template (`--family qwen3`): the SFT rows
are the template's own rendering and the episodes' own tokens, and a model SFT'd on them writes
a Hermes call that the rollout layer parses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.rollout.call_formats import answer_text, detect_format, raw_calls
from posttrain.tasks.tool_world import calculator, family_sft_rows


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_qwen3_rows_are_the_templates_calls_and_the_episodes_tokens(family_builder) -> None:
    tok = AutoTokenizer.from_pretrained(family_builder("qwen3"))
    assert detect_format(tok) == "hermes"
    rows = family_sft_rows(tok, 40, 0, tool_rate=0.5)
    calls = [r for r in rows if "<tool_call>" in r["completion"]]
    copies = [r for r in rows if "<tool_response>" in r["prompt"]]
    assert calls and len(calls) == len(copies) and len(rows) == 40 + len(calls)
    for row in calls:  # the call exactly as the template writes the assistant's tool_calls
        expr = row["prompt"].split("user\n")[1].split("<|im_end|>")[0]
        msg = {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
               "function": {"name": "calculator", "arguments": {"expression": expr}}}]}
        whole = tok.apply_chat_template([{"role": "user", "content": expr}, msg], tokenize=False)
        assert whole.startswith(row["prompt"] + row["completion"])
        assert row["completion"].endswith("</tool_call><|im_end|>")
        assert raw_calls(tok, "hermes", row["completion"]) == [
            {"name": "calculator", "arguments": {"expression": expr}}]
    for row in copies:  # the episode's tokens: the call turn's ids, then the answer's ids
        head = next(c for c in calls if row["prompt"].startswith(c["prompt"] + c["completion"]))
        expr = head["prompt"].split("user\n")[1].split("<|im_end|>")[0]
        answer = answer_text(tok, "hermes", "calculator", [("calculator", calculator(expr))],
                             "<|im_end|>")
        assert answer.startswith("\n<|im_start|>user\n<tool_response>\n")
        assert _ids(tok, row["prompt"]) == (_ids(tok, head["prompt"])
                                            + _ids(tok, head["completion"]) + _ids(tok, answer))
        assert row["completion"] == f"<think>\n\n</think>\n\n<answer>{calculator(expr)}</answer>" \
                                    "<|im_end|>"


@pytest.mark.slow
def test_qwen3_world_builds_and_its_sft_model_writes_a_hermes_call(family_builder,
                                                                   tmp_path) -> None:
    from posttrain.config import SFTConfig, build_config
    from posttrain.tasks.tool_world import build_tool_world
    from posttrain.trainers.sft import SFTTrainer

    family_builder("qwen3")  # the npm tokenizer, cached
    summary = build_tool_world(tmp_path / "w", quick=True, progress=False, family="qwen3")
    init = json.loads((tmp_path / "w" / "init" / "config.json").read_text())
    assert init["model_type"] == "qwen3" and init["vocab_size"] == 151_936
    rows = [json.loads(line) for line in Path(summary["paths"]["sft"]).read_text().splitlines()]
    calls = [r for r in rows if "<tool_call>" in r["completion"]][:4]
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in calls))
    SFTTrainer(build_config(SFTConfig, overrides={  # from the world's SFT start, the calls only
        "model": summary["paths"]["sft_model"], "train_data": str(data), "max_steps": 40,
        "batch_size": 4, "lr": 1e-2, "warmup_steps": 0, "lr_schedule": "constant",
        "out_dir": str(tmp_path / "sft"), "threads": 1, "progress": False, "rewards": [],
        "report_to": []})).train()
    path = tmp_path / "sft" / "final"
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    enc = tok(calls[0]["prompt"], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:])  # special tokens kept, as episodes do
    parsed = raw_calls(tok, "hermes", text)
    assert isinstance(parsed, list) and len(parsed) == 1, text
    assert parsed[0]["name"] == "calculator" and "expression" in parsed[0]["arguments"], text
    assert text.startswith("<think>\n\n</think>\n\n<tool_call>\n"), text


def test_the_qwen3_recipe_loads_with_its_tool_and_parser() -> None:
    from posttrain.config import GRPOConfig, build_config
    from posttrain.rollout.tools import AgentSpec

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "grpo_tools_qwen3.yaml"
    cfg = build_config(GRPOConfig, recipe)
    assert cfg.agentic() and cfg.tool_call_parser == "hermes" and cfg.tool_schemas == "none"
    assert AgentSpec.build(cfg).tools == {"calculator": calculator}
    assert cfg.model == "runs/tools_qwen3/sft/final"  # where --family qwen3 --out runs/tools_qwen3
    assert not build_config(GRPOConfig, recipe, overrides={"tools": []}).agentic()  # control
