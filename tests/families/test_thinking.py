"""Thinking models: Qwen3's `enable_thinking` through `chat_template_kwargs` wherever prompts
are rendered, its thinking kept token for token across tool turns (as its template keeps the
reasoning of the turns after the last user query), and rewards read the answer, not the
thinking."""

from __future__ import annotations

import pickle

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.rewards import format_reward, math_reward
from posttrain.rollout.episodes import AgentSampler
from posttrain.rollout.hf import SamplingParams
from posttrain.rollout.tools import AgentSpec, tool_schemas
from posttrain.trainers.grpo import GRPOTrainer
from tests.families.test_tool_calls import NATIVE, Scripted, add, ids

NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_enable_thinking_reaches_every_rendered_prompt(family_builder, tmp_path):
    path = family_builder("qwen3")
    rows = [{"prompt": "2+3?", "answer": "5"}] * 2
    for kwargs, end in (({"enable_thinking": False}, NO_THINK),
                        ({}, "<|im_start|>assistant\n")):
        tok = AutoTokenizer.from_pretrained(path)
        t = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), tokenizer=tok,
                        train_data=rows, rewards=["math"], max_steps=1, progress=False,
                        report_to=[], threads=1, out_dir=str(tmp_path / str(len(kwargs))),
                        chat_template_kwargs=kwargs, group_size=2, prompts_per_step=2)
        assert t.session.render("2+3?").endswith(end)
        assert t.session.render("2+3?").endswith(NO_THINK) == bool(kwargs)
        again = pickle.loads(pickle.dumps(t.session.tokenizer))  # the async sampler's copy
        assert again.apply_chat_template([{"role": "user", "content": "2+3?"}], tokenize=False,
                                         add_generation_prompt=True).endswith(end)


def test_thinking_before_a_call_stays_as_the_template_keeps_it(family_builder):
    """The model thinks, then calls; the episode's ids after the answer are exactly the
    template's rendering of the conversation with that reasoning on the assistant message."""
    tok = AutoTokenizer.from_pretrained(family_builder("qwen3"))
    turn = "<think>\nI should add.\n</think>\n\n" + NATIVE["qwen3"]
    stop = ids(tok, turn)[-1]
    inner = Scripted(tok, [ids(tok, turn), ids(tok, "5") + [stop]], [stop])
    eng = AgentSampler(inner, AgentSpec({"add": add}, None, 2, 5.0))
    r = eng.generate(rows=[{"prompt": "2+3?"}], params=SamplingParams(256, greedy=True))
    assert r.episodes[0]["calls"] == 1 and r.episodes[0]["errors"] == {}
    msgs = [{"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "", "reasoning_content": "I should add.",
             "tool_calls": [{"type": "function", "function": {"name": "add",
                                                               "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "name": "add", "content": "5"}]
    whole = tok.apply_chat_template(msgs, tools=tool_schemas([add]), tokenize=False,
                                    add_generation_prompt=True)
    assert inner.seen[1][0] == ids(tok, whole)


def test_rewards_read_the_answer_not_the_thinking():
    # what the rewards get for a Qwen3 completion: its text, special tokens removed (<think>
    # is an ordinary added token there, so it stays)
    assert math_reward("<think>\nmaybe \\boxed{4}\n</think>\n\nIt is \\boxed{5}.", "5") == 1.0
    assert math_reward("<think>\nit is \\boxed{5}\n</think>\n\nI am not sure.", "5") == 0.0
    assert math_reward("<think>\n2+3=5\n</think>\n\n<answer>5</answer>", "5") == 1.0
    assert format_reward("<think>\n2+3=5\n</think>\n\n<answer>5</answer>") == 0.1
    assert math_reward("<think>a+b=c</think><answer>5</answer>", "5") == 1.0  # the demo's


def test_the_keys_from_yaml_and_the_command_line(tmp_path):
    from posttrain.config import ConfigError, GRPOConfig
    from posttrain.config.base import build_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\ntrain_data: x.jsonl\nchat_template_kwargs:\n"
                      "  enable_thinking: false\n  reasoning_effort: low\n")
    cfg = build_config(GRPOConfig, recipe, ["tool_call_parser=openai"])
    assert cfg.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert cfg.tool_call_parser == "openai"
    cfg = build_config(GRPOConfig, None, ["model=m", "train_data=x.jsonl",
                                          "chat_template_kwargs={enable_thinking: false}"])
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="tool_call_parser='mistral': expected one of"):
        build_config(GRPOConfig, None, ["model=m", "train_data=x.jsonl",
                                        "tool_call_parser=mistral"])
