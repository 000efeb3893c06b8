"""The tool path (posttrain/rollout/tools.py) under a model that writes anything: the parser
never raises (fuzzed), calls reported timed out never run, calls and turns are bounded, one
bound for all sandboxes of a process, the python tool's containment, async tools, environments
checked before any model loads."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.config import GRPOConfig
from posttrain.rollout.episodes import AgentSampler, tool_turn_text
from posttrain.rollout.hf import SamplingParams
from posttrain.rollout.tools import AgentSpec, ToolCall, call_tools, parse_tool_calls
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout.script_lm import ScriptedHF, ScriptLM, ids

TOK = build_char_tokenizer()


def cfg(**kw: object) -> SimpleNamespace:
    """A GRPO config's values with `kw` (unchecked: any key reaches `AgentSpec.build`)."""
    return SimpleNamespace(**{**dataclasses.asdict(GRPOConfig()), **kw})


def echo(text: str) -> str:
    """Say it back.

    Args:
        text: anything.
    """
    return text


def call(name: str, **args: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def episode(turn: str, spec: AgentSpec, budget: int = 0, **row: object):  # noqa: ANN201
    """One greedy episode whose model writes `turn`, then `x` until its budget."""
    inner = ScriptedHF(TOK)
    inner.script_model = ScriptLM(ids(TOK, "<s>Q\n" + turn + "</s>" + "x" * 2000), len(TOK))
    inner.update_weights(inner.script_model, 0)
    eng = AgentSampler(inner, spec)
    r = eng.generate([], rows=[{"prompt": "Q", **row}], group_size=1,
                     params=SamplingParams(budget or len(ids(TOK, turn)) + 1500, greedy=True))
    return r.episodes[0], [m for m in r.rows[0]["messages"] if m["role"] == "tool"]


# --- 47.6: anything the model writes is data ---------------------------------------------

SPECIAL = ["<tool_call>", "</tool_call>", "</s>", "<s>", "<tool_response>", "</tool_response>",
           "<|im_start|>", "<|im_end|>", "<answer>", "<think>", "\ud800", "\udfff", "\x00",
           "\u202e", "\ufeff", "\U0001d7d8", '"', "\\", "\\ud800", "{", "}", "[", "]", ":"]
FRAGMENT = st.one_of(
    st.text(max_size=40), st.sampled_from(SPECIAL),
    st.integers(1, 3000).map(lambda n: "[" * n), st.integers(1, 3000).map(lambda n: '{"a":' * n),
    st.integers(4000, 6000).map(lambda n: "9" * n),
    st.binary(max_size=30).map(lambda b: b.decode("utf-8", "surrogateescape")))
CALL_TEXT = st.lists(FRAGMENT, max_size=6).map("".join)


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(before=CALL_TEXT, inside=CALL_TEXT, after=CALL_TEXT, args=CALL_TEXT)
def test_fuzz_the_parser_never_raises_and_keeps_arguments(before: str, inside: str,
                                                          after: str, args: str) -> None:
    """Random and adversarial text (deep nesting, numbers past 4,300 digits, lone surrogates,
    undecodable bytes, the template's own special tokens) as a whole turn, inside a call block
    and as a call's argument: a list of calls or a message, never an exception; an argument
    holding special tokens comes back as written; the answers tokenize."""
    for text in (before + "<tool_call>" + inside + "</tool_call>" + after, inside,
                 before + call("echo", text=args) + after):
        got = parse_tool_calls(TOK, text)
        assert isinstance(got, str) or all(isinstance(c, ToolCall) for c in got)
    got = parse_tool_calls(TOK, call("echo", text=args))
    if "</tool_call>" not in json.dumps(args):  # the fallback format's one limit
        assert [(c.name, c.arguments) for c in got] == [("echo", {"text": args})]
        answers = call_tools([({"echo": echo}, got)], 5.0)[0]
        TOK(tool_turn_text(TOK, answers, "</s>"), add_special_tokens=False)


@pytest.mark.parametrize(("text", "message"), [
    ("<tool_call>" + "[" * 1200 + "</tool_call>", "recursion depth"),
    ('<tool_call>{"name": "echo", "arguments": {"text": ' + "9" * 4400 + "}}</tool_call>",
     "4300"),
])
def test_deep_nesting_and_huge_numbers_are_parse_errors_in_the_episode(text: str,
                                                                       message: str) -> None:
    ep, tool = episode(text, AgentSpec({"echo": echo}, None, 2, 1.0))
    assert ep["errors"] == {"parse": 1} and ep["turns"] == 2  # the episode went on
    assert message in tool[0]["content"]


def test_a_tokenizer_parser_returning_anything_is_a_parse_error() -> None:
    class Schema:
        response_schema = {"x": 1}

        def __init__(self, out: object) -> None:
            self.out = out

        def parse_response(self, text: str) -> object:
            if isinstance(self.out, BaseException):
                raise self.out
            return self.out

    for out in ({"tool_calls": ["x"]}, {"tool_calls": [{"function": 3}]}, ["x"], None,
                RecursionError("deep"), {"tool_calls": [{"name": "f", "arguments": "[" * 5000}]}):
        assert isinstance(parse_tool_calls(Schema(out), "anything"), str), out


def test_a_lone_surrogate_echoed_by_a_tool_does_not_crash_the_episode() -> None:
    ep, tool = episode('<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}'
                       "</tool_call>", AgentSpec({"echo": echo}, None, 2, 1.0))
    assert ep["errors"] == {} and tool[0]["content"] == "a?b"


def test_unclosed_tags_parse_in_linear_time() -> None:
    t0 = time.perf_counter()
    assert "closing" in parse_tool_calls(TOK, "<tool_call>" * 5000)
    assert time.perf_counter() - t0 < 0.3  # the lazy regex took 1.7 s (quadratic)


# --- 47.7: a call reported timed out never runs later ------------------------------------

class Slow:
    """An environment whose `wait` outlives the call's limit."""

    made: list[Slow] = []

    def reset(self, **row: object) -> None:
        self.log: list[str] = []
        Slow.made.append(self)

    def wait(self, s: float) -> str:
        """Sleep, then record.

        Args:
            s: seconds.
        """
        time.sleep(s)
        self.log.append("wait")
        return "waited"

    def poke(self) -> str:
        """Record at once."""
        self.log.append("poke")
        return "poked"


def test_calls_after_a_timeout_never_run_and_the_environment_is_closed() -> None:
    spec = AgentSpec({"echo": echo}, Slow, 2, 0.2)
    env = spec.new_environment({})
    env.reset()
    fns = spec.episode_tools(env)
    t0 = time.monotonic()
    got = call_tools([(fns, [ToolCall("wait", {"s": 0.6}), ToolCall("poke", {}),
                             ToolCall("echo", {"text": "e"})])], 0.2)[0]
    assert time.monotonic() - t0 < 0.5
    assert [r.error for r in got] == ["timeout", "timeout", "timeout"]
    assert "timed out after 0.2 s" in got[0].content and "not run" in got[1].content
    nxt = call_tools([(fns, [ToolCall("poke", {}), ToolCall("echo", {"text": "e"})])], 0.2)[0]
    assert nxt[0].error == "timeout" and "not run" in nxt[0].content  # the env is closed
    assert (nxt[1].error, nxt[1].content) == (None, "e")  # plain tools still answer
    time.sleep(0.8)
    assert env.log == ["wait"]  # the timed-out call finished; nothing after it ran


def test_a_later_turn_never_touches_an_environment_whose_call_timed_out() -> None:
    """In the episode loop: turn 1's call times out, turn 2 pokes the environment while the
    timed-out call still sleeps; the poke is answered, not run."""
    t1, t2 = call("wait", s=0.8) + "</s>", call("poke") + "</s>"
    a1 = "<tool_response>error: wait timed out after 0.2 s</tool_response>\n"
    inner = ScriptedHF(TOK)
    inner.script_model = ScriptLM(ids(TOK, "<s>Q\n" + t1 + a1 + t2 + "x" * 400), len(TOK))
    inner.update_weights(inner.script_model, 0)
    eng = AgentSampler(inner, AgentSpec({}, Slow, 3, 0.2))
    r = eng.generate([], rows=[{"prompt": "Q"}], group_size=1,
                     params=SamplingParams(len(ids(TOK, t1 + a1 + t2)) + 150, greedy=True))
    tool = [m["content"] for m in r.rows[0]["messages"] if m["role"] == "tool"]
    assert tool[0] == "error: wait timed out after 0.2 s" and "not run" in tool[1]
    assert r.episodes[0]["errors"] == {"timeout": 2}
    time.sleep(1.0)
    assert Slow.made[-1].log == ["wait"]
    assert r.rows[0]["environments"] is None  # closed: no reward reads what a late call changes


def test_a_timed_out_async_tool_is_cancelled() -> None:
    done: list[int] = []

    async def later(x: int) -> str:
        """Finish late.

        Args:
            x: anything.
        """
        await asyncio.sleep(0.5)
        done.append(x)
        return "late"

    got = call_tools([({"later": later}, [ToolCall("later", {"x": 1})])], 0.1)[0]
    assert got[0].error == "timeout"
    time.sleep(0.8)
    assert done == []


# --- 47.8: calls per turn and the turn's wall time are bounded -----------------------------

def test_calls_per_turn_are_bounded_with_an_error_message() -> None:
    ran: list[str] = []

    def note(x: str) -> str:
        """Note it.

        Args:
            x: anything.
        """
        ran.append(x)
        return x

    ep, tool = episode("".join(call("note", x=str(i)) for i in range(9)),
                       AgentSpec({"note": note}, None, 2, 1.0))  # the default: 8
    assert len(ran) == 8 and ep["errors"] == {"too_many": 1} and len(tool) == 9
    ran.clear()
    spec = AgentSpec.build(cfg(max_tool_calls_per_turn=3), [note])
    fns = spec.episode_tools(None)
    got = call_tools([(fns, [ToolCall("note", {"x": str(i)}) for i in range(5)])], 1.0)[0]
    assert ran == ["0", "1", "2"] and [r.error for r in got] == [None] * 3 + ["too_many"] * 2
    assert "at most 3 tool calls per turn" in got[4].content


def test_a_turn_of_calls_is_bounded_in_wall_time() -> None:
    def nap(s: float) -> str:
        """Sleep.

        Args:
            s: seconds.
        """
        time.sleep(s)
        return "ok"

    spec = AgentSpec.build(cfg(tool_timeout_s=1.0, tool_turn_timeout_s=0.5), [nap])
    t0 = time.monotonic()
    got = call_tools([(spec.episode_tools(None), [ToolCall("nap", {"s": 0.3})] * 4)], 1.0)[0]
    assert time.monotonic() - t0 < 0.9  # 4 x 0.3 s before
    assert [r.error for r in got] == [None, "timeout", "timeout", "timeout"]
    assert "the turn's 0.5 s" in got[1].content


# --- 47.9 / 47.10: the python tool's sandboxes ---------------------------------------------

def test_python_tool_and_code_rewards_share_one_bound_per_process() -> None:
    from posttrain.rewards.code import code_reward
    from posttrain.rollout.tools import python
    from posttrain.sandbox import SANDBOXES

    cores = max(1, os.cpu_count() or 1)
    for _ in range(cores):  # every sandbox of the process taken
        assert SANDBOXES.acquire(timeout=5)
    assert not SANDBOXES.acquire(blocking=False)  # no more than one per core
    scored: list[float] = []
    worker = threading.Thread(target=lambda: scored.append(code_reward("x = 1", "assert x == 1")))
    try:
        got = call_tools([({"python": python}, [ToolCall("python", {"code": "print(42)"})])],
                         0.5)[0]
        worker.start()
        worker.join(0.5)
        assert got[0].error == "timeout" and scored == []  # both wait for a free sandbox
    finally:
        for _ in range(cores):
            SANDBOXES.release()
    worker.join(30)
    assert scored == [1.0]


def test_python_tool_refuses_limits_mode_unless_set(monkeypatch, capsys) -> None:
    from posttrain.rollout import tools
    from posttrain.sandbox import SandboxUnavailableError
    from posttrain.sandbox import jail as sandbox_run

    monkeypatch.setattr(tools, "_SANDBOX_MODE", {"mode": "strict"}, raising=False)
    monkeypatch.setattr(tools, "_SAID", set(), raising=False)
    monkeypatch.setattr(sandbox_run, "_BWRAP_OK", {})  # probe again, without bubblewrap
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="config key 'sandbox_mode'.*sandbox_mode: limits"):
        AgentSpec.build(cfg(tools=["python"]))
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):  # never limits alone
        tools.python("print(1)")
    for _ in range(2):
        AgentSpec.build(cfg(tools=["python"], sandbox_mode="limits"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "resource limits only" in lines[0]  # once, in one line


def test_python_tool_says_its_containment_once(monkeypatch, capsys) -> None:
    from posttrain.rollout import tools
    from posttrain.sandbox import SandboxUnavailableError, run_sandboxed

    try:
        run_sandboxed("", mode="strict")
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")
    monkeypatch.setattr(tools, "_SAID", set(), raising=False)
    for _ in range(2):
        AgentSpec.build(cfg(tools=["python"]))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "bubblewrap" in lines[0]


# --- 48.1: async tools and get_reward are awaited ------------------------------------------

async def add_later(a: int, b: int) -> int:
    """Add, asynchronously.

    Args:
        a: the first.
        b: the second.
    """
    await asyncio.sleep(0)
    return a + b


def test_an_async_tool_is_awaited_on_one_loop() -> None:
    ep, tool = episode(call("add_later", a=2, b=3), AgentSpec({"add_later": add_later}, None,
                                                               2, 1.0))
    assert ep["errors"] == {} and tool[0]["content"] == "5"

    async def loop_id() -> int:
        """The running loop's id."""
        return id(asyncio.get_running_loop())

    got = call_tools([({"loop_id": loop_id}, [ToolCall("loop_id", {})] * 2)] * 2, 1.0)
    assert len({r.content for rs in got for r in rs}) == 1  # one event loop for the run


def test_an_async_get_reward_is_awaited() -> None:
    from posttrain.rewards.registry import environment_reward

    class Env:
        async def get_reward(self) -> float:
            await asyncio.sleep(0)
            return 1.0

    assert environment_reward(["c"], [Env()]) == [1.0]


# --- 48.7 / 48.8 / 48.11: environments checked before any model loads -----------------------

class NoReset:
    def step(self, x: int) -> str:
        """Step.

        Args:
            x: how far.
        """
        return str(x)


class Bare:
    def reset(self, **row: object) -> None:
        pass

    def step(self, x):  # noqa: ANN001, ANN201
        return x


class AsyncReset(Bare):
    async def reset(self, **row: object) -> None:  # type: ignore[override]
        pass

    def step(self, x: int) -> str:
        """Step.

        Args:
            x: how far.
        """
        return str(x)


@pytest.mark.parametrize(("factory", "message"), [
    (Slow(), "config key 'environment': got an instance of Slow.*pass the class"),
    (NoReset, "config key 'environment': NoReset needs a method reset"),
    (Bare, "config key 'environment': Bare.'step' needs type hints"),
    (AsyncReset, "AsyncReset needs a method reset.*synchronous"),
    ({"ok": Slow, "bad": NoReset}, r"config key 'environment' \('bad'\): NoReset"),
])
def test_environments_are_checked_when_the_spec_is_built(factory: object,
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentSpec.build(cfg(), None, factory)


def test_rows_must_name_a_known_environment() -> None:
    from posttrain.rollout.tools import check_environment_rows

    spec = AgentSpec.build(cfg(), None, {"slow": Slow})
    check_environment_rows(spec, [{"environment": "slow"}])
    for row, shown in (({}, "None"), ({"environment": "fast"}, "'fast'"),
                       ({"environment": ["slow"]}, r"\['slow'\]")):
        with pytest.raises(ValueError, match=f"row 2 of train_data has environment={shown}; each "
                                             r"row names one of \['slow'\]"):
            check_environment_rows(spec, [{"environment": "slow"}, row])
    check_environment_rows(AgentSpec.build(cfg(), None, Slow), [{}])  # one class: no field
