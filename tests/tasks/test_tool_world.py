"""The tool world's data and calculator (posttrain/tasks/tool_world.py)."""

from __future__ import annotations

import pytest

from posttrain.data import render_prompt
from posttrain.rollout.tools import parse_tool_calls, tool_schemas
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.tasks.tool_world import calculator, problems, prompt_rows, sft_rows, tool_call


def test_calculator_is_exact_and_refuses_other_code() -> None:
    assert calculator("999*999") == "998001" and calculator("(2+3)*-4") == "-20"
    assert calculator("__import__('os')").startswith("error: ValueError: not an integer")
    assert tool_schemas([calculator])[0]["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize("expression", ["__import__('os')", "1+", "1//0", "2.5*2", "-" * 100_000
                                        + "1", "(" * 300 + "1" + ")" * 300, 12, None, "9" * 5000])
def test_a_bad_expression_is_the_calculators_answer_never_a_tool_failure(expression) -> None:
    """What the model wrote is data (issue 56): the call answers an error text, and the
    rollout does not count it toward the failing-tools rule (error kind None)."""
    from posttrain.rollout.tools import ToolCall, _run_one

    assert calculator(expression).startswith("error: ")
    result = _run_one({"calculator": calculator}, ToolCall("calculator",
                                                           {"expression": expression}))
    assert result.error is None and result.content.startswith("error: "), result


def test_heldout_is_disjoint_and_products_have_six_digits() -> None:
    train, held = set(problems(2000, 0, "train")), set(problems(500, 0, "heldout"))
    assert not train & held
    assert all(len(str(a * b)) == 6 for a, b in train | held)
    assert prompt_rows(1, 0)[0]["answer"] == str(eval(prompt_rows(1, 0)[0]["prompt"]))


def test_sft_rows_render_as_the_episodes_the_rollout_builds() -> None:
    tok = build_char_tokenizer()
    rows = sft_rows(200, 0, tool_rate=0.5)
    with_tool = [r for r in rows if len(r["messages"]) == 4]
    assert 0.3 < len(with_tool) / 200 < 0.7  # the tool on about half the problems
    msgs = with_tool[0]["messages"]
    text = render_prompt(tok, msgs[:3], "auto")  # the prompt of the copy row
    call = tool_call(msgs[0]["content"])
    assert text == (f"<s>{msgs[0]['content']}\n{call}</s><tool_response>"
                    f"{calculator(msgs[0]['content'])}</tool_response>\n")
    assert [c.name for c in parse_tool_calls(tok, call)] == ["calculator"]


def test_the_recipe_loads_with_its_tool() -> None:
    from pathlib import Path

    from posttrain.config import GRPOConfig, build_config
    from posttrain.rollout.tools import AgentSpec

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "grpo_tools.yaml"
    cfg = build_config(GRPOConfig, recipe)
    assert cfg.agentic() and cfg.max_tool_calling_iterations == 2
    assert AgentSpec.build(cfg).tools == {"calculator": calculator}
    off = build_config(GRPOConfig, recipe, overrides={"tools": []})
    assert not off.agentic()  # the control run of docs/results.md


def test_quick_build_runs_phase_two_from_phase_one_at_a_constant_lr(tmp_path) -> None:
    import yaml

    from posttrain.tasks.tool_world import WORLD, build_tool_world

    summary = build_tool_world(tmp_path, quick=True, progress=False)
    cfg = yaml.safe_load((tmp_path / "sft" / "config.yaml").read_text())
    assert cfg["model"] == str(tmp_path / "sft_phase1" / "final")
    # the copy needs many high-lr steps: a cosine decay over phase 2 never learned it
    assert cfg["lr_schedule"] == "constant" and cfg["lr"] == WORLD["sft_more"]["lr"]
    assert summary["paths"]["sft_model"] == str(tmp_path / "sft" / "final")
