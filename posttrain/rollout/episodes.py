"""Multi-turn episodes with tools and environments on every rollout engine (docs/agents.md).

An episode: the prompt (the row's, with the tools' schemas through the chat template and the
environment's `reset` text appended to the last user message) -> the model samples a turn
until a stop id -> the turn's tool calls run (all episodes of a turn concurrently) -> their
answers are appended as `tool` messages -> the model samples again, up to
`max_tool_calling_iterations` rounds and `max_new_tokens` tokens for the whole episode.

Token in, token out: the sampled ids are never decoded and re-tokenized; only the tool messages
are tokenized and appended. In the `Rollout`, `completion_ids` [N, T] hold the model's turns and
the tool answers in order, `completion_mask` marks every real token (what attention sees) and
`response_mask` only the model's (what the loss, the KL, the entropy and the sampler's log-probs
cover: the tool tokens have log-prob 0 and count nowhere).

The episode loop is shared; each engine supplies one turn (`AgentEngine._turn_sampler`): `hf`
continues each episode on its KV cache of the last turn (`posttrain.rollout.hf.sample_turn`:
only the tokens appended since, the turn's last sampled id and the tool answers, are
prefilled; finished episodes free their rows; the samples are those of re-prefilling the whole
episode, to float rounding); the vLLM engines send each context as token ids (vLLM's
automatic prefix caching can reuse the earlier turns). Each episode samples at most its own
remaining budget. Notation: N sequences, T completion tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttrain.core.runtime import sequence_seed
from posttrain.rollout.hf import (
    Carried,
    SamplingParams,
    sample_turn,
    sequence_uniforms,
    stop_token_ids,
)
from posttrain.rollout.record import Rollout
from posttrain.rollout.tools import (
    ERROR_KINDS,
    AgentSpec,
    ToolCall,
    ToolResult,
    call_tools,
    parse_tool_calls,
    tool_schemas,
)
from posttrain.rollout.vllm_convert import cut_at_stop

__all__ = ["AGENT_COUNTS", "AgentEngine", "Episode", "episode_metrics", "tool_turn_text"]

AGENT_COUNTS = frozenset({"agent/episodes", "agent/tool_calls", "agent/tool_errors/",
                          "agent/cut_by_turns", "agent/cut_by_length"})
"""The per-rank counts among `episode_metrics` (summed over ranks: `count_metrics`)."""
_MARK = "\u2063ASSISTANT\u2063"
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
    by_tool: dict[str, list] = dataclasses.field(default_factory=dict)
    """tool name -> [calls, failures (raised or timed out), first failure message]."""

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.model += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def stats(self) -> dict[str, Any]:
        return {"turns": self.turns, "calls": self.calls, "errors": dict(self.errors),
                "cut": self.cut, "tool_tokens": self.model.count(False),
                "tokens": len(self.ids), "by_tool": self.by_tool}


def tool_turn_text(tokenizer: Any, results: list[ToolResult], stop_text: str) -> str:
    """The text that follows a model turn ending in `stop_text` and answers it with `results`:
    the chat template's rendering of the `tool` messages and of the next generation prompt
    (what a conversation ending in them adds after an assistant message), without the
    end-of-turn the model already sampled. A template that does not know tools gets each answer
    wrapped as `<tool_response>...</tool_response>`; no template: those lines alone."""
    template = tokenizer.chat_template or ""
    wrap = "tool" not in template
    msgs = [{"role": "tool", "name": r.name,
             "content": f"<tool_response>{r.content}</tool_response>" if wrap else r.content}
            for r in results]
    if not template:
        return "".join(m["content"] + "\n" for m in msgs)
    dummy = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
    base = tokenizer.apply_chat_template(dummy, tokenize=False)
    full = tokenizer.apply_chat_template(dummy + msgs, tokenize=False, add_generation_prompt=True)
    cut = base.index(_MARK) + len(_MARK)
    if full[:cut] != base[:cut]:
        raise ValueError("the chat template renders an assistant message differently when tool "
                         "messages follow it: tool answers cannot be appended as tokens")
    tail = full[cut:]
    return tail[len(stop_text):] if stop_text and tail.startswith(stop_text) else tail


class AgentEngine:
    """The rollout-engine protocol over an `hf` or vLLM engine, sampling multi-turn episodes.

    `render(messages, schemas)` renders a prompt (the trainer's system prompt and chat
    template); `generate` takes the rows (the rendered `prompts` are rebuilt from them with the
    tools and the environment's `reset` text) and returns a `Rollout` whose `rows` carry the
    episode (`messages`, `environments`: the instance or None) for the reward functions and
    whose `episodes` hold each episode's counts (`episode_metrics`)."""

    def __init__(self, inner: Any, spec: AgentSpec,
                 render: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str]) -> None:
        if not hasattr(inner, "sample_ids") and not (
                getattr(inner, "name", None) == "hf" and hasattr(inner, "sampler")):
            raise ValueError(f"config key 'rollout_engine': multi-turn tool rollouts run on the "
                             f"hf and vLLM engines, not {getattr(inner, 'name', inner)!r}")
        self.inner, self.spec, self.render = inner, spec, render
        self.name, self.runs_policy = inner.name, inner.runs_policy
        self.tokenizer = inner.tokenizer

    def update_weights(self, model: torch.nn.Module, version: int) -> None:
        self.inner.update_weights(model, version)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()

    def start(self, row: dict[str, Any]) -> Episode:
        """A new episode of `row`: its environment reset, its prompt rendered and tokenized."""
        env = self.spec.new_environment(row)
        prompt = row["prompt"]
        messages = ([dict(m) for m in prompt] if isinstance(prompt, list)
                    else [{"role": "user", "content": prompt}])
        obs = env.reset(**row) if env is not None else None
        if obs:
            messages[-1]["content"] = str(messages[-1]["content"]) + str(obs)
        tools = self.spec.episode_tools(env)
        text = self.render(messages, tool_schemas(list(tools.values())))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Episode(list(ids), messages, tools, env)

    def generate(self, prompts: list[str], *, group_size: int = 1,
                 params: SamplingParams | None = None, seeds: list[int] | None = None,
                 stop_ids: list[int] | None = None, rows: list[dict[str, Any]] | None = None,
                 batch_size: int = 0, generator: torch.Generator | None = None) -> Rollout:
        params = params or SamplingParams()
        rows = rows or [{"prompt": p} for p in prompts]
        eps = [self.start(r) for r in rows for _ in range(group_size)]
        for k, e in enumerate(eps):
            e.key = k
        with self._turn_sampler(params, stop_ids, generator) as sample:
            for turn in range(self.spec.max_turns + 1):
                live = [k for k, e in enumerate(eps) if not e.done]
                if not live:
                    break
                now = [eps[k] for k in live]
                turn_seeds = [sequence_seed(seeds[k], "turn", turn) for k in live] if seeds \
                    else None
                self._take_turn(now, sample(now, turn_seeds), turn)
                self._answer_calls(now, params.max_new_tokens)
        return self._record(eps, rows, group_size)

    @contextlib.contextmanager
    def _turn_sampler(self, params: SamplingParams, stop_ids: list[int] | None,
                      generator: torch.Generator | None
                      ) -> Iterator[Callable[[list[Episode], list[int] | None], list[Turn]]]:
        """The engine's side of a turn: `sample(live episodes, their seeds of this turn)` ->
        one `Turn` each, continued from the episode's ids (prompt + so far) and within its own
        remaining budget. vLLM: one request of token ids per episode, all in one call."""
        if hasattr(self.inner, "sample_ids"):  # the vLLM engines
            stops = list(stop_ids) if stop_ids is not None else self.inner.stops
            yield functools.partial(self._vllm_turn, params, stops, generator)
            return
        model, autocast = self.inner.sampler()
        was_training = model.training
        model.eval()
        try:
            stops = list(stop_ids) if stop_ids is not None else stop_token_ids(
                model, self.tokenizer)
            carried: list[Carried | None] = [None]  # the live episodes' KV cache, turn to turn

            def sample(now: list[Episode], turn_seeds: list[int] | None) -> list[Turn]:
                turns, carried[0] = self._sample_turn(model, autocast, params, stops, generator,
                                                      now, turn_seeds, carried[0])
                return turns

            yield sample
        finally:
            if was_training:
                model.train()

    def _sample_turn(self, model: torch.nn.Module, autocast: bool, params: SamplingParams,
                     stops: list[int], generator: torch.Generator | None, eps: list[Episode],
                     seeds: list[int] | None, carried: Carried | None
                     ) -> tuple[list[Turn], Carried | None]:
        """hf: one model turn of the live episodes, continued on their KV cache (`carried`, the
        last turn's: only the tokens appended since are prefilled), each within its own budget;
        also returns the cache to carry to the next turn."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stops[0]
        room = [params.max_new_tokens - len(e.ids) for e in eps]
        uniforms = (sequence_uniforms(seeds, max(room))
                    if seeds is not None and not params.greedy else None)  # [n, T]
        toks, rmask, lps, trunc, carried = sample_turn(
            model, [e.prompt + e.ids for e in eps], [e.key for e in eps], room, params, stops,
            pad, autocast, generator, uniforms, carried)
        toks, lps, trunc = toks.cpu(), lps.cpu(), trunc.cpu()
        turns = [(toks[i, :n].tolist(), lps[i, :n].tolist(), bool(trunc[i]))
                 for i, n in enumerate(rmask.sum(1).tolist())]  # trunc: no stop id in budget
        return turns, carried

    def _vllm_turn(self, params: SamplingParams, stops: list[int],
                   generator: torch.Generator | None, eps: list[Episode],
                   seeds: list[int] | None) -> list[Turn]:
        """vLLM: one request per live episode, its token ids so far (never re-tokenized text),
        `max_tokens` its own remaining budget; all of them in one call."""
        outs = self.inner.sample_ids([e.prompt + e.ids for e in eps], params, stops,
                                     seeds=seeds, generator=generator,
                                     max_tokens=[params.max_new_tokens - len(e.ids) for e in eps])
        return [cut_at_stop(c, set(stops), i) for i, c in enumerate(outs)]

    def _take_turn(self, eps: list[Episode], turns: list[Turn], turn: int) -> None:
        """Append each episode's sampled turn and parse its tool calls (or end it)."""
        for e, (ids, logprobs, cut) in zip(eps, turns, strict=True):
            e.add(ids, logprobs)
            e.turns += 1
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            e.messages.append({"role": "assistant", "content": text})
            if cut:
                e.cut, e.done = "length", True
                continue
            calls = parse_tool_calls(self.tokenizer, text)
            if calls == []:
                e.done = True
            elif turn >= self.spec.max_turns:
                e.cut, e.done = "turns", True
            else:
                e.pending = calls
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
            text = tool_turn_text(self.tokenizer, results, e.stop_text)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(e.ids) + len(ids) >= max_new_tokens:
                e.cut, e.done = "length", True
                continue
            e.add(list(ids), None)
            e.messages += [{"role": "tool", "name": r.name, "content": r.content}
                           for r in results]

    def _record(self, eps: list[Episode], rows: list[dict[str, Any]], G: int) -> Rollout:
        """The episodes as one group-contiguous `Rollout` (prompts left padded, completions
        right padded; `response_mask` on the model's tokens only)."""
        pad = self.tokenizer.pad_token_id or 0
        N, P = len(eps), max(len(e.prompt) for e in eps)
        T = max(1, max(len(e.ids) for e in eps))
        prompt_ids = torch.full((N, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros((N, P), dtype=torch.bool)
        completion_ids = torch.full((N, T), pad, dtype=torch.long)
        completion_mask = torch.zeros((N, T), dtype=torch.bool)
        response_mask = torch.zeros((N, T), dtype=torch.bool)
        logprobs = torch.zeros((N, T))
        for i, e in enumerate(eps):
            n = len(e.ids)
            prompt_ids[i, P - len(e.prompt):] = torch.tensor(e.prompt)
            prompt_mask[i, P - len(e.prompt):] = True
            completion_ids[i, :n] = torch.tensor(e.ids, dtype=torch.long)
            completion_mask[i, :n] = True
            response_mask[i, :n] = torch.tensor(e.model, dtype=torch.bool)
            logprobs[i, :n] = torch.tensor(e.logprobs)
        texts = [self.tokenizer.decode(e.ids, skip_special_tokens=True) for e in eps]
        out_rows = [{**rows[i // G], "messages": e.messages, "environments": e.env}
                    for i, e in enumerate(eps)]
        return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                       completion_ids=completion_ids, response_mask=response_mask,
                       logprobs=logprobs, truncated=torch.tensor([e.cut == "length" for e in eps]),
                       group_size=G, completions=texts, rows=out_rows,
                       completion_mask=completion_mask, episodes=[e.stats() for e in eps])


def episode_metrics(episodes: list[dict[str, Any]]) -> tuple[dict[str, float],
                                                          dict[str, tuple[float, float]]]:
    """This rank's `agent/*` metrics of a step's episodes: the counts (`AGENT_COUNTS`, summed
    over ranks) and the means as (value, weight): `agent/turns_mean` per episode,
    `agent/tool_token_share` per completion token (model + tool)."""
    tokens = sum(e["tokens"] for e in episodes)
    counts = {"agent/episodes": float(len(episodes)),
              "agent/tool_calls": float(sum(e["calls"] for e in episodes)),
              "agent/cut_by_turns": float(sum(e["cut"] == "turns" for e in episodes)),
              "agent/cut_by_length": float(sum(e["cut"] == "length" for e in episodes))}
    for kind in ERROR_KINDS:
        counts[f"agent/tool_errors/{kind}"] = float(sum(e["errors"].get(kind, 0)
                                                        for e in episodes))
    means = {"agent/turns_mean": (sum(e["turns"] for e in episodes) / max(1, len(episodes)),
                                  float(len(episodes))),
             "agent/tool_token_share": (sum(e["tool_tokens"] for e in episodes) / max(1, tokens),
                                        float(tokens))}
    return counts, means
