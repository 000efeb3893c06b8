"""Multi-turn episodes with tools and environments on every sampler (docs/agents.md).

An episode: the prompt (tools' schemas through the chat template, the environment's `reset`
text appended to the last user message) -> the model samples a turn until a stop id -> the
turn's tool calls run (all episodes concurrently) -> answers appended as `tool` messages ->
sample again, up to `max_tool_calling_iterations` rounds and `max_new_tokens` for the episode.
Token in, token out: sampled ids are never re-tokenized; only tool messages are tokenized. In
the `Rollout`, `completion_ids` [N, T] hold turns and tool answers, `completion_mask` every real
token, `response_mask` only the model's (loss, KL, entropy, sampler log-probs; tool tokens have
log-prob 0). A turn is one `sample_ids` call: `hf` continues on its KV cache of the last turn,
vLLM gets token ids (prefix caching); each episode samples at most its remaining budget.
Notation: N sequences, T completion tokens.
More: docs/agents.md, "Module notes", posttrain.rollout.episodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from posttrain.core.errors import UserFunctionError
from posttrain.core.runtime import sequence_seed
from posttrain.data.prompts import as_messages, render_prompt, uses_template
from posttrain.rollout.call_formats import answer_text, detect_format
from posttrain.rollout.completion import cut_at_stop
from posttrain.rollout.hf import SamplingParams
from posttrain.rollout.record import Rollout, pad_id
from posttrain.rollout.tools import (
    ERROR_KINDS,
    AgentSpec,
    ToolCall,
    ToolResult,
    call_tools,
    parse_tool_calls,
    tool_schemas,
)

__all__ = ["AGENT_COUNTS", "AgentSampler", "Episode", "ToolFailureError", "agent_keys",
           "check_failing_tools", "episode_metrics", "render_episode", "tool_turn_text"]

AGENT_COUNTS = frozenset({"agent/episodes", "agent/tool_calls", "agent/tool_errors/",
                          "agent/cut_by_turns", "agent/cut_by_length",
                          "agent/cut_by_tool_answer"})
"""The per-rank counts among `episode_metrics` (summed over ranks: `count_metrics`)."""
Turn = tuple[list[int], list[float], bool]
"""One episode's sampled turn: its ids (through the stop id, within its budget), their
sampler log-probs, and whether it was cut (no stop id within the episode's budget)."""


@dataclasses.dataclass
class Episode:
    """One rollout's state: its prompt ids, what it produced, its tools and environment."""

    prompt: list[int]
    messages: list[dict[str, Any]]
    tools: dict[str, Callable[..., Any]]
    env: Any = None
    key: int = 0
    """Its index in the step's episodes (the name of its rows in the carried KV cache)."""
    ids: list[int] = dataclasses.field(default_factory=list)
    tool_overflow: int = 0
    """Tokens of the tool answer that did not fit in the episode's budget (it ended there)."""
    said: list[str] = dataclasses.field(default_factory=list)
    """The model's turns as text (special tokens skipped): what rewards read."""
    model: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    calls: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    cut: str | None = None
    """None (finished), "turns" (a call on the last turn) or "length" (max_new_tokens)."""
    done: bool = False
    pending: list[ToolCall] | str | None = None
    """The last turn's calls to answer, or the message of a call that did not parse."""
    stop_text: str = ""
    """The text of the stop id that ended the last turn."""
    call_name: str = ""
    """The name of the last turn's first call (the templates that name the call's answer)."""
    by_tool: dict[str, list] = dataclasses.field(default_factory=dict)
    """tool name -> [calls, failures (raised or timed out), first failure message]."""

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.model += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def stats(self) -> dict[str, Any]:
        return {"turns": self.turns, "calls": self.calls, "errors": dict(self.errors),
                "cut": self.cut, "tool_tokens": self.model.count(False),
                "tokens": len(self.ids), "by_tool": self.by_tool,
                "tool_overflow": self.tool_overflow}


def tool_turn_text(tokenizer: Any, results: list[ToolResult], stop_text: str,
                   fmt: str = "hermes", name: str | None = None) -> str:
    """The text that follows a model turn ending in `stop_text` (a call to `name`, in format
    `fmt`) and answers it with `results`: what the chat template writes after the assistant's
    turn for the `tool` messages and the next generation prompt, without the end-of-turn the
    model already sampled (`posttrain.rollout.call_formats.answer_text`)."""
    return answer_text(tokenizer, fmt, results[0].name if name is None else name,
                       [(r.name, r.content) for r in results], stop_text)


def render_episode(tokenizer: Any, messages: list[dict[str, Any]],
                   schemas: list[dict[str, Any]], chat_template: str = "auto",
                   system_prompt: str = "") -> str:
    """An episode's prompt: the system prompt, then the chat template with the tools' schemas
    where the tokenizer's template takes them (`chat_template: auto`), else `render_prompt`."""
    if not system_prompt and len(messages) == 1 and not uses_template(tokenizer, chat_template):
        return str(messages[0]["content"])  # a plain string prompt, no template: as it is
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if schemas and takes_tools(tokenizer, chat_template):
        return tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                             add_generation_prompt=True)
    return render_prompt(tokenizer, messages, chat_template)


def takes_tools(tokenizer: Any, chat_template: str = "auto") -> bool:
    """Whether the tokenizer's chat template renders tool schemas (`tools` in it)."""
    return chat_template == "auto" and "tools" in (tokenizer.chat_template or "")


def check_tool_template(tokenizer: Any, chat_template: str, tool_schemas: str) -> None:
    """Refuse (one line) tools whose schemas the chat template would silently drop."""
    if tool_schemas == "template" and not takes_tools(tokenizer, chat_template):
        raise ValueError(f"config key 'tool_schemas'=template: the chat template "
                         f"(chat_template={chat_template[:40]!r}) renders no tool schemas "
                         "('tools' is not in it), so the model would never see its tools; use "
                         "a tokenizer whose template takes tools (TRL requires one), or set "
                         "tool_schemas: none for a model that knows its tools (docs/agents.md)")


class AgentSampler:
    """The sampler protocol over an `hf` or vLLM sampler, sampling multi-turn episodes.

    `generate` renders each episode's prompt from its row (`renders_rows`: the callers pass no
    rendered prompts), with the tools' schemas, the environment's `reset` text, `chat_template`
    and `system_prompt`, and returns a `Rollout` whose `rows` carry the episode (`messages`,
    `environments`: the instance or None) for the reward functions and whose `episodes` hold
    each episode's counts (`episode_metrics`). Each turn is one `sample_ids` call of the inner
    sampler (`hf` carries its KV cache from turn to turn; vLLM's prefix cache does the same)."""

    renders_rows = True

    def __init__(self, inner: Any, spec: AgentSpec, chat_template: str = "auto",
                 system_prompt: str = "", tool_schemas: str = "template",
                 tool_call_parser: str = "auto") -> None:
        if not hasattr(inner, "sample_ids"):
            raise ValueError(f"config key 'rollout_engine': multi-turn tool rollouts run on the "
                             f"hf and vLLM samplers, not {getattr(inner, 'name', inner)!r}")
        self.inner, self.spec = inner, spec
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.show_schemas = tool_schemas == "template"
        self.name, self.runs_policy = inner.name, inner.runs_policy
        self.tokenizer = inner.tokenizer
        self.call_format = detect_format(self.tokenizer, tool_call_parser)

    def update_weights(self, model: torch.nn.Module, weights_version: int) -> None:
        self.inner.update_weights(model, weights_version)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()

    def start(self, row: dict[str, Any]) -> Episode:
        """A new episode of `row`: its environment reset, its prompt rendered and tokenized."""
        env = self.spec.new_environment(row)
        messages = [dict(m) for m in as_messages(row["prompt"])]
        obs = env.reset(**row) if env is not None else None
        if obs:
            messages[-1]["content"] = str(messages[-1]["content"]) + str(obs)
        tools = self.spec.episode_tools(env)
        schemas = tool_schemas(list(tools.values())) if self.show_schemas else []
        text = render_episode(self.tokenizer, messages, schemas, self.chat_template,
                              self.system_prompt)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Episode(list(ids), messages, tools, env)

    def generate(self, prompts: list[str] | None = None, *, group_size: int = 1,
                 params: SamplingParams | None = None, seeds: list[int] | None = None,
                 stop_ids: list[int] | None = None, rows: list[dict[str, Any]] | None = None,
                 batch_size: int = 0, generator: torch.Generator | None = None) -> Rollout:
        """`group_size` episodes per row (`prompts` without `rows`: one user message each)."""
        params = params or SamplingParams()
        rows = rows or [{"prompt": p} for p in prompts or []]
        eps = [self.start(r) for r in rows for _ in range(group_size)]
        stops = list(stop_ids) if stop_ids is not None else self.inner.stops
        try:
            for turn in range(self.spec.max_turns + 1):
                now = [(k, e) for k, e in enumerate(eps) if not e.done]
                if not now:
                    break
                outs = self.inner.sample_ids(
                    [e.prompt + e.ids for _, e in now], params, stops, generator=generator,
                    seeds=[sequence_seed(seeds[k], "turn", turn) for k, _ in now] if seeds
                    else None, max_tokens=[params.max_new_tokens - len(e.ids) for _, e in now],
                    keys=[k for k, _ in now])  # each within its own remaining budget
                self._take_turn([e for _, e in now], [cut_at_stop(c, set(stops), k) for (k, _), c
                                                      in zip(now, outs, strict=True)], turn)
                self._answer_calls([e for _, e in now], params.max_new_tokens)
        finally:
            self.inner.end_turns()
        return Rollout.from_sequences(
            [e.prompt for e in eps], [e.ids for e in eps], [e.logprobs for e in eps],
            [e.cut == "length" for e in eps], group_size=group_size,
            pad_token_id=pad_id(self.tokenizer, stops), tokenizer=None,
            rows=[{**rows[i // group_size], "messages": e.messages,  # a closed env: a late call
                   "environments": None if getattr(e.tools, "closed", False) else e.env,
                   "environment_closed": getattr(e.tools, "closed", False)}  # scored lowest
                  for i, e in enumerate(eps)],  # may still change it; no reward reads it
            model_tokens=[e.model for e in eps], episodes=[e.stats() for e in eps],
            texts=["\n".join(e.said) for e in eps])  # rewards read what the model wrote

    def _take_turn(self, eps: list[Episode], turns: list[Turn], turn: int) -> None:
        """Append each episode's sampled turn and parse its tool calls (or end it)."""
        for e, (ids, logprobs, cut) in zip(eps, turns, strict=True):
            e.add(ids, logprobs)
            e.turns += 1
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            e.messages.append({"role": "assistant", "content": text})
            e.said.append(text)
            if cut:
                e.cut, e.done = "length", True
                continue
            calls = parse_tool_calls(self.tokenizer, self.tokenizer.decode(  # markers kept
                ids, skip_special_tokens=False), fmt=self.call_format)
            if calls == []:
                e.done = True
            elif turn >= self.spec.max_turns:
                e.cut, e.done = "turns", True
            else:
                e.pending = calls
                e.call_name = calls[0].name if isinstance(calls, list) else ""
                e.stop_text = self.tokenizer.decode(ids[-1:])

    def _answer_calls(self, eps: list[Episode], max_new_tokens: int) -> None:
        """Run the pending calls of every episode (concurrently) and append the answers as
        `tool` message tokens; an episode with no room left for a model token ends."""
        waiting = [e for e in eps if not e.done]
        jobs = [(e.tools, e.pending) for e in waiting if not isinstance(e.pending, str)]
        answers = iter(call_tools(jobs, self.spec.timeout_s))
        for e in waiting:
            if isinstance(e.pending, str):  # the call did not parse
                results = [ToolResult("", f"error: {e.pending}", "parse")]
            else:
                results = next(answers)
                e.calls += len(results)
            for r in results:
                if r.error:
                    e.errors[r.error] = e.errors.get(r.error, 0) + 1
                if r.name in e.tools:  # the tool's own record (not the model's bad calls)
                    t = e.by_tool.setdefault(r.name, [0, 0, ""])
                    failed = r.error in ("exception", "timeout")
                    t[0], t[1] = t[0] + 1, t[1] + failed
                    t[2] = t[2] or (r.content if failed else "")
            e.pending = None
            text = tool_turn_text(self.tokenizer, results, e.stop_text, self.call_format,
                                  e.call_name)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(e.ids) + len(ids) >= max_new_tokens:
                e.cut, e.done, e.tool_overflow = "length", True, len(ids)  # the answer's fault
                continue
            e.add(list(ids), None)
            e.messages += [{"role": "tool", "name": r.name, "content": r.content}
                           for r in results]


def episode_metrics(episodes: list[dict[str, Any]]) -> tuple[dict[str, float],
                                                          dict[str, tuple[float, float]]]:
    """This rank's `agent/*` metrics of a step's episodes: the counts (`AGENT_COUNTS`, summed
    over ranks) and the means as (value, weight): `agent/turns_mean` per episode,
    `agent/tool_token_share` per completion token (model + tool)."""
    tokens = sum(e["tokens"] for e in episodes)
    counts = {"agent/episodes": float(len(episodes)),
              "agent/tool_calls": float(sum(e["calls"] for e in episodes)),
              "agent/cut_by_turns": float(sum(e["cut"] == "turns" for e in episodes)),
              "agent/cut_by_length": float(sum(e["cut"] == "length" for e in episodes)),
              "agent/cut_by_tool_answer": float(sum(e["tool_overflow"] > 0 for e in episodes))}
    for kind in ERROR_KINDS:
        counts[f"agent/tool_errors/{kind}"] = float(sum(e["errors"].get(kind, 0)
                                                        for e in episodes))
    means = {"agent/turns_mean": (sum(e["turns"] for e in episodes) / max(1, len(episodes)),
                                  float(len(episodes))),
             "agent/tool_token_share": (sum(e["tool_tokens"] for e in episodes) / max(1, tokens),
                                        float(tokens))}
    return counts, means


class ToolFailureError(UserFunctionError):
    """A tool raised or timed out on most of its calls of a step."""

    kind = "tool"


def check_failing_tools(per_rank: list[list[dict[str, list]]]) -> None:
    """Raise `ToolFailureError` naming the first tool that failed (raised or timed out) on more
    than half of its calls this step (at least 2), with its first error message; `per_rank`:
    every rank's episodes' `by_tool` counts."""
    total: dict[str, list] = {}
    for rank in per_rank:
        for by_tool in rank:
            for name, (calls, fails, first) in by_tool.items():
                t = total.setdefault(name, [0, 0, ""])
                t[0], t[1], t[2] = t[0] + calls, t[1] + fails, t[2] or first
    for name, (calls, fails, first) in total.items():
        if calls >= 2 and 2 * fails > calls:
            raise ToolFailureError(f"tool {name!r} failed on {fails} of its {calls} calls this "
                                   f"step (raised or timed out); first: {first}")


def agent_keys(tools: list[Any] | None, environment_factory: Any) -> dict[str, Any]:
    """The config keys (`tools`, `environment`) that record TRL's `tools=[f, ...]` and
    `environment_factory=Cls | {name: Cls}` as `module:qualname` import paths."""
    def path(obj: Any) -> str:
        if isinstance(obj, str):
            return obj
        return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"

    keys: dict[str, Any] = {}
    if tools is not None:
        keys["tools"] = [path(t) for t in tools]
    if environment_factory is not None:
        keys["environment"] = ({k: path(v) for k, v in environment_factory.items()}
                               if isinstance(environment_factory, dict)
                               else path(environment_factory))
    return keys
