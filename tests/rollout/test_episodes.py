"""Multi-turn episodes (posttrain/rollout/episodes.py, tools.py): token in, token out, the masks,
every failure kind as data, the limits, environments, the sandboxed python tool."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

import posttrain.rollout.episodes as episodes
import posttrain.rollout.sampler as sampler_module
from posttrain.rollout.episodes import (
    AgentSampler,
    ToolFailureError,
    check_failing_tools,
    episode_metrics,
    tool_turn_text,
)
from posttrain.rollout.hf import SamplingParams, sample_tokens
from posttrain.rollout.sampler import HFSampler
from posttrain.rollout.tools import AgentSpec, ToolCall, ToolResult, parse_tool_calls
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout.script_lm import ScriptedHF, ScriptLM, ids

TOK = build_char_tokenizer()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything.
    """
    raise RuntimeError("kaput")


def slow(x: str) -> str:
    """Sleeps past its limit.

    Args:
        x: anything.
    """
    time.sleep(1.5)
    return "late"


def call(name: str, **args: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call></s>"


def answer(text: str) -> str:
    return f"<tool_response>{text}</tool_response>\n"


def sampler(script: str, tools: list, *, factory: object = None, turns: int = 3,
           timeout: float = 0.5) -> AgentSampler:
    inner = ScriptedHF(TOK)
    inner.script_model = ScriptLM(ids(TOK, script), len(TOK))
    inner.update_weights(inner.script_model, 0)
    spec = AgentSpec({f.__name__: f for f in tools}, factory, turns, timeout)
    return AgentSampler(inner, spec)


def run(eng: AgentSampler, prompt: str = "Q", n: int = 1, budget: int = 300, **kw: object):
    return eng.generate([], rows=[{"prompt": prompt, **kw}], group_size=n,
                        params=SamplingParams(budget, greedy=True))


def test_token_in_token_out_and_masks_golden() -> None:
    m1, t1, m2 = call("add", a=2, b=3), answer("5"), "<answer>5</answer></s>"
    r = run(sampler("<s>Q\n" + m1 + t1 + m2, [add]), n=2)
    want = ids(TOK, m1) + ids(TOK, t1) + ids(TOK, m2)
    n1, nt, n2 = len(ids(TOK, m1)), len(ids(TOK, t1)), len(ids(TOK, m2))
    # one id per character; </s> and the reasoning tags are one id each:
    # m1 = 11 (<tool_call>) + 46 (the JSON) + 12 (</tool_call>) + 1 (</s>) = 70
    # t1 = 15 + 1 + 16 + 1 (newline) = 33; m2 = <answer> 5 </answer> </s> = 4
    assert (n1, nt, n2) == (70, 33, 4)
    for i in range(2):
        assert r.completion_ids[i].tolist() == want  # the sampled ids + the tool's, exactly
        assert r.response_mask[i].tolist() == [True] * n1 + [False] * nt + [True] * n2
        assert r.completion_mask[i].all()
        assert (r.logprobs[i, n1:n1 + nt] == 0).all()  # no sampler log-prob on tool tokens
        assert (r.logprobs[i, :n1] > -1e-3).all()
    assert r.prompt_ids[0].tolist() == ids(TOK, "<s>Q\n")
    assert r.episodes[0] | {"by_tool": None} == {
        "turns": 2, "calls": 1, "errors": {}, "cut": None, "tool_tokens": 33,
        "tokens": 107, "by_tool": None, "tool_overflow": 0}
    msgs = r.rows[0]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[2]["content"] == "5" and r.completions[0].endswith("<answer>5</answer>")
    assert r.attention_mask is r.completion_mask


def leak(x: str) -> str:
    """A tool whose answer holds an answer block.

    Args:
        x: anything.
    """
    return "<answer>5</answer>"


def test_rewards_read_what_the_model_wrote_not_the_tools_answers() -> None:
    """A tool that prints `<answer>5</answer>` scores nothing for a model that wrote no answer
    (docs/agents.md): the completion is the model's turns; the tool's answer is in `messages`."""
    from posttrain.rewards import math_reward

    m1, m2 = call("leak", x="q") + "", "no idea</s>"
    r = run(sampler("<s>Q\n" + m1 + answer("<answer>5</answer>") + m2, [leak]))
    assert [m["role"] for m in r.rows[0]["messages"]] == ["user", "assistant", "tool",
                                                           "assistant"]
    assert r.rows[0]["messages"][2]["content"] == "<answer>5</answer>"
    assert "<answer>" not in r.completions[0] and r.completions[0].endswith("no idea")
    assert math_reward(r.completions[0], "5") == 0.0


def reprefill_turn(model, contexts, keys, limits, params, eos, pad, autocast, generator,
                   uniforms, carried):  # noqa: ANN001, ANN201
    """A turn as episodes ran it before the cache was carried: `sample_tokens` on the whole
    left-padded contexts for as many tokens as the most budget left, each row cut at its own."""
    width = max(map(len, contexts))
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.bool)
    for i, c in enumerate(contexts):
        ids[i, width - len(c):], mask[i, width - len(c):] = torch.tensor(c), True
    toks, rmask, lps, _ = sample_tokens(
        model, ids, mask, dataclasses.replace(params, max_new_tokens=max(limits)), eos, pad,
        autocast, generator, 1, uniforms)
    rmask = rmask & (torch.arange(toks.shape[1])[None, :] < torch.tensor(limits)[:, None])
    ended = (torch.isin(toks, torch.tensor(eos)) & rmask).any(1)
    return toks, rmask, lps * rmask, ~ended, None


def test_episodes_on_the_carried_cache_equal_reprefilling_each_turn(monkeypatch) -> None:
    """Episodes of a tiny Llama (a turn that ends with a stop id calls `add` unless its text
    has a length divisible by 5: 1 to 4 turns, some cut at the budget) continued on the KV
    cache: the ids, masks and log-probs (to 1e-5) of re-prefilling every episode at every
    turn, and no position past the prompt + `max_new_tokens` (re-prefilling went past it)."""
    model = build_tiny_llama(TOK, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, seed=1).eval()
    with torch.no_grad():  # EOS likely: turns end at different steps
        model.get_output_embeddings().weight[TOK.eos_token_id] = 0.6
    positions: list[int] = []
    model.register_forward_pre_hook(
        lambda m, a, kw: positions.append(int(kw["position_ids"].max())), with_kwargs=True)
    monkeypatch.setattr(episodes, "parse_tool_calls", lambda tok, text, **kw: []
                        if len(text) % 5 == 0 else [ToolCall("add", {"a": len(text), "b": 1})])
    inner = HFSampler(TOK)
    inner.update_weights(model, 0)
    eng = AgentSampler(inner, AgentSpec({"add": add}, None, 3, 5.0))
    rows = [{"prompt": p} for p in ["12+7", "3*41", "abcd", "wxyz"]]  # one length

    def sample() -> tuple[object, int]:
        positions.clear()
        r = eng.generate([], rows=rows, group_size=4, params=SamplingParams(80),
                         seeds=list(range(16)))
        return r, max(positions)

    ours, ours_pos = sample()
    monkeypatch.setattr(sampler_module, "sample_turn", reprefill_turn)
    ref, ref_pos = sample()
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    for key in ("response_mask", "completion_mask", "truncated", "prompt_ids"):
        assert torch.equal(getattr(ours, key), getattr(ref, key)), key
    assert torch.allclose(ours.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    assert ours.episodes == ref.episodes
    turns = [e["turns"] for e in ours.episodes]
    assert max(turns) == 3 and min(turns) == 1 and 0 < sum(e["cut"] == "length"
                                                           for e in ours.episodes) < 16
    assert ours.completion_mask.sum(1).max() <= 80
    bound = ours.prompt_mask.sum(1).max() + 80  # positions 0 .. prompt + budget - 1
    assert ours_pos < bound <= ref_pos


@pytest.mark.parametrize(("turn", "kind", "message"), [
    ("<tool_call>{nope}</tool_call></s>", "parse", "not valid JSON"),
    (call("mul", a=1), "unknown_tool", "unknown tool 'mul'"),
    (call("add", a=1), "bad_arguments", "missing a required argument: 'b'"),
    (call("boom", x="1"), "exception", "RuntimeError: kaput"),
    (call("slow", x="1"), "timeout", "timed out after 0.5 s"),
])
def test_every_failure_kind_is_a_tool_message_and_a_counter(turn: str, kind: str,
                                                            message: str) -> None:
    eng = sampler("<s>Q\n" + turn + "x" * 400, [add, boom, slow])
    r = run(eng, budget=len(ids(TOK, turn)) + 250)
    ep = r.episodes[0]
    assert ep["errors"] == {kind: 1} and ep["turns"] == 2  # the episode went on
    tool_msg = r.rows[0]["messages"][2]
    assert tool_msg["role"] == "tool" and message in tool_msg["content"]
    n1 = len(ids(TOK, turn))
    sent = TOK.decode(r.completion_ids[0, n1:][~r.response_mask[0, n1:]])
    assert sent.startswith("<tool_response>error: ")  # the model reads what went wrong
    counts, _ = episode_metrics(r.episodes)
    assert counts[f"agent/tool_errors/{kind}"] == 1.0


def test_turn_and_length_limits_cut_episodes() -> None:
    m1, t1 = call("add", a=2, b=3), answer("5")
    r = run(sampler("<s>Q\n" + (m1 + t1) * 4, [add], turns=1))
    assert r.episodes[0]["cut"] == "turns" and r.episodes[0]["turns"] == 2
    assert not bool(r.truncated[0])
    r = run(sampler("<s>Q\n" + m1 + t1 + "y" * 300, [add]), budget=150)
    assert r.episodes[0]["cut"] == "length" and bool(r.truncated[0])
    assert r.completion_mask[0].sum() <= 150
    counts, means = episode_metrics(r.episodes)
    assert counts["agent/cut_by_length"] == 1.0 and means["agent/tool_token_share"][1] <= 150


class Counter:
    """A stateful environment: the next observation depends on the last action."""

    resets = 0

    def reset(self, **row: object) -> str:
        Counter.resets += 1
        self.total = int(row["start"])
        return f" start={self.total}"

    def step(self, by: int) -> str:
        """Add to the counter and read it.

        Args:
            by: how much to add.
        """
        self.total += by
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total == 10)


def test_stateful_environment_one_instance_per_rollout() -> None:
    c1, c2 = call("step", by=3), call("step", by=3)
    script = "<s>Q start=4\n" + c1 + answer("7") + c2 + answer("10") + "<answer>10</answer></s>"
    Counter.resets = 0
    r = run(sampler(script, [], factory=Counter), n=3, start=4)
    assert Counter.resets == 3  # reset once per rollout, with the row
    envs = [row["environments"] for row in r.rows]
    assert len({id(e) for e in envs}) == 3 and [e.total for e in envs] == [10, 10, 10]
    assert [m["content"] for m in r.rows[0]["messages"] if m["role"] == "tool"] == ["7", "10"]
    assert r.rows[0]["messages"][0]["content"] == "Q start=4"  # reset text on the user turn
    from posttrain.rewards.registry import environment_reward
    assert environment_reward(r.completions, envs) == [1.0, 1.0, 1.0]


def test_environment_dict_selected_by_the_row() -> None:
    spec = AgentSpec({}, {"counter": Counter}, 2, 1.0)
    assert isinstance(spec.new_environment({"environment": "counter"}), Counter)
    with pytest.raises(ValueError, match="config key 'environment'.*'other'"):
        spec.new_environment({"environment": "other"})


def test_python_tool_runs_in_the_sandbox() -> None:
    import os

    from posttrain.rollout.tools import python
    from posttrain.sandbox import SandboxUnavailableError

    try:
        out = python("import os\nprint(os.getpid(), 6 * 7)")
    except SandboxUnavailableError as err:
        pytest.skip(f"no sandbox here: {err}")
    pid, value = out.split()
    assert value == "42" and int(pid) != os.getpid()
    assert python("raise SystemExit(3)").startswith("error: the program")  # an answer


def test_parse_and_render_fallback_format() -> None:
    assert parse_tool_calls(TOK, "no call") == []
    calls = parse_tool_calls(TOK, call("add", a=1, b=2) + call("add", a=3, b=4))
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}),
                                                     ("add", {"a": 3, "b": 4})]
    assert "closing" in parse_tool_calls(TOK, "<tool_call>{")
    text = tool_turn_text(TOK, [ToolResult("add", "3"), ToolResult("add", "7")], "</s>")
    assert text == answer("3") + answer("7")  # the char template knows no tool role


def test_a_tool_failing_on_most_calls_stops_the_run() -> None:
    check_failing_tools([[{"add": [4, 2, "e"]}]])  # half: goes on
    with pytest.raises(ToolFailureError, match="'boom' failed on 3 of its 4 calls.*kaput"):
        check_failing_tools([[{"boom": [2, 2, "RuntimeError: kaput"]}], [{"boom": [2, 1, ""]}]])


def test_schemas_need_docstrings() -> None:
    def bare(x):  # noqa: ANN001, ANN202
        return x

    class Cfg:
        tools, environment, max_tool_calling_iterations, tool_timeout_s = [], "", 2, 1.0
        sandbox_mode = "limits"  # no bubblewrap check: this test is about schemas

    with pytest.raises(ValueError, match="config key 'tools': 'bare'"):
        AgentSpec.build(Cfg, [bare], None)
    Cfg.tools = ["python"]  # the built-in sandboxed tool, by name in YAML
    from posttrain.rollout.tools import python
    assert AgentSpec.build(Cfg).tools == {"python": python}
    assert torch.is_tensor(torch.zeros(1))
