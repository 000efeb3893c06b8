"""What a trainer run holds besides its algorithm: data, rewards, model, evaluation, progress.

`load_session` validates the config, the reward specs and every data row BEFORE any model is
loaded, so bad input fails in a second with the file, line and field named; then, with only the
tokenizer and the model's config read, conversational rows against the chat template and RL
prompt lengths against `max_prompt_len` and the context (`check_rows`); then the weights.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.config import BaseConfig, ConfigError
from posttrain.config.base import check_trackers
from posttrain.core.device import resolve_device
from posttrain.data import as_messages, load_rows, render_prompt, validate_rows
from posttrain.data.loading import in_memory_rows
from posttrain.data.render_checks import check_prompt_lengths, check_renderable
from posttrain.engine.values import RewardValues, RunValues
from posttrain.models import apply_lora, load_model_and_tokenizer, load_tokenizer, model_context
from posttrain.models.lora import check_lora_targets
from posttrain.rewards.registry import Rewards, RewardSpec, validate_specs
from posttrain.rollout import SamplingParams
from posttrain.rollout.call_formats import check_call_format
from posttrain.rollout.episodes import check_tool_template
from posttrain.rollout.sampler import Sampler, build_sampler
from posttrain.rollout.tools import check_environment_rows


@dataclass
class Session:
    cfg: BaseConfig
    model: Any
    tokenizer: Any
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    rewards: Rewards | None = None
    reward_names: list[str] = field(default_factory=list)
    dist: Any = None
    """The trainer's `Dist` under torchrun: evaluation is sharded by rank and gathered."""
    sampler: Sampler | None = None
    """What held-out evaluation samples with; None: one built from the config for the model
    evaluated (`rollout_engine`; the trainer sets its own vLLM sampler or episodes here)."""
    values: RunValues = field(default_factory=RunValues)
    """The trainer's values beyond `BaseConfig`'s keys (`posttrain.engine.values`)."""

    def render(self, prompt: Any) -> str:
        system = self.cfg.system_prompt
        if system:
            prompt = [{"role": "system", "content": system}, *as_messages(prompt)]
        return render_prompt(self.tokenizer, prompt, self.cfg.chat_template)

    def maybe_lora(self) -> None:
        """Wrap the policy in LoRA adapters when `lora_r` > 0 (only adapters train)."""
        if self.cfg.lora_r > 0:
            self.model = apply_lora(self.model, r=self.cfg.lora_r, alpha=self.cfg.lora_alpha,
                                    target_modules=self.cfg.lora_target_modules)

    @torch.no_grad()
    def evaluate(self, model: Any, prefix: str = "", dump: str | None = None) -> dict[str, Any]:
        """Greedy decoding on the held-out rows, scored by the reward functions.

        `accuracy` is the fraction of prompts whose first reward function (the correctness
        reward by convention) returns >= 1.0; `format_rate` the fraction with a positive format
        reward (when one is configured); `reward_mean` the mean weighted score. `dump` names a
        JSONL file in out_dir that receives every prompt, completion and verdict.
        """
        if not self.eval_rows or self.rewards is None:
            return {}
        cfg = self.cfg
        rows = self.eval_rows[: cfg.eval_size]
        max_new = self.values.generation.eval_max_new_tokens
        completions, first, scores, fmt, lengths = self._greedy_scored(model, rows, max_new)
        valid = [v for v in first if v == v]  # drop NaN (unscorable)
        out: dict[str, Any] = {
            f"{prefix}accuracy": sum(v >= 1.0 for v in valid) / max(1, len(valid)),
            f"{prefix}reward_mean": sum(s for s in scores if s == s) / max(1, len(valid)),
            f"{prefix}n": len(valid),
            f"{prefix}length_mean": sum(lengths) / max(1, len(lengths)),
        }
        if fmt is not None:
            out[f"{prefix}format_rate"] = sum(v > 0 for v in fmt) / len(rows)
        if not prefix:
            out["samples"] = [{"prompt": r["prompt"], "completion": c}
                              for r, c in zip(rows[:5], completions[:5], strict=True)]
        if dump and (self.dist is None or self.dist.is_main):
            path = Path(self.cfg.out_dir) / dump
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as fh:
                for r, c, v, s in zip(rows, completions, first, scores, strict=True):
                    fh.write(json.dumps({"prompt": r["prompt"], "answer": r.get("answer"),
                                         "completion": c, "correct": v >= 1.0, "score": s},
                                        default=str) + "\n")
        return out

    def _greedy_scored(self, model: Any, rows: list[dict[str, Any]], max_new: int
                       ) -> tuple[list[str], list[float], list[float], list[float] | None,
                                  list[float]]:
        """Greedy completions of the `rows`' prompts, scored: (completions, first reward function,
        weighted scores, format reward or None, lengths), in row order. Under torchrun each
        rank decodes and scores every `world`-th row and the results are gathered."""
        cfg = self.cfg
        mine = list(range(len(rows))) if self.dist is None else self.dist.shard(
            list(range(len(rows))))
        per_row: list[tuple[int, str, float, float, float | None, float]] = []
        if mine:
            sampler = self.sampler or build_sampler(cfg, self.tokenizer, role="eval", model=model)
            if not sampler.runs_policy:  # a vLLM sampler loaded from `model`: kept for next time
                self.sampler = sampler
            prompts = [] if getattr(sampler, "renders_rows", False) else [
                self.render(rows[i]["prompt"]) for i in mine]  # episodes render their own
            rollout = sampler.generate(prompts, rows=[rows[i] for i in mine],
                                      params=SamplingParams(max_new_tokens=max_new, greedy=True),
                                      batch_size=cfg.eval_batch_size)
            result = self.rewards.score(rollout.completions,  # episodes: + messages, env
                                       rollout.rows or [rows[i] for i in mine])
            fmt = result.per_function.get("format")
            lengths = rollout.response_mask.sum(1).tolist()
            per_row = [(i, rollout.completions[k], result.per_function[self.reward_names[0]][k],
                        result.scores[k], fmt[k] if fmt is not None else None,
                        float(lengths[k])) for k, i in enumerate(mine)]
        if self.dist is not None:
            per_row = sorted(x for part in self.dist.all_gather_objects(per_row) for x in part)
        has_format = "format" in self.reward_names
        return ([x[1] for x in per_row], [x[2] for x in per_row], [x[3] for x in per_row],
                [x[4] for x in per_row] if has_format else None, [x[5] for x in per_row])

    def log_reward_errors(self, errors: list[dict[str, Any]]) -> None:
        """Append reward-function crashes (with the sample) to reward_errors.jsonl."""
        if not errors:
            return
        path = Path(self.cfg.out_dir) / "reward_errors.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            for err in errors:
                fh.write(json.dumps(err, default=str) + "\n")

    @contextlib.contextmanager
    def progress(self, total: int, desc: str) -> Iterator[_Bar]:
        bar = _Bar(total, desc, enabled=self.cfg.progress)
        try:
            yield bar
        finally:
            bar.close()


class _Bar:
    """A rich progress bar showing reward and accuracy; silent when disabled or not a TTY."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total}"),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._progress.start()
            self._task = self._progress.add_task(desc, total=total, info="")

    def update(self, **fields: float | None) -> None:
        if self._progress is None:
            return
        info = " ".join(f"{k}={v:.3f}" for k, v in fields.items() if v is not None)
        self._progress.update(self._task, advance=1, info=info)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _normalise_rows(rows: list[dict[str, Any]], answer_field: str,
                    marker: str) -> list[dict[str, Any]]:
    """Expose the configured answer field to reward functions as `answer` (after `marker`)."""
    if answer_field == "answer" and not marker:
        return rows
    out = []
    for r in rows:
        answer = r.get(answer_field)
        if marker and isinstance(answer, str) and marker in answer:
            answer = answer.rsplit(marker, 1)[1].strip()
        out.append({**r, "answer": answer})
    return out


def data_columns(cfg: BaseConfig, field_: str) -> dict[str, str]:
    """`columns` with `field_`, the prompt's field (`prompt_field`: GRPO, PPO), folded in as
    `{prompt: <prompt_field>}`."""
    columns = dict(cfg.columns)
    if field_ != "prompt":
        if columns.get("prompt", field_) != field_:
            raise ConfigError(f"config keys 'prompt_field'={field_!r} and 'columns': columns "
                              f"maps prompt to {columns['prompt']!r}; set only one")
        columns["prompt"] = field_
    return columns


def _rows(cfg: BaseConfig, prompt_field: str, source: Any, kind: str, split: str,
          limit: int | None = None, require: dict[str, str] | None = None
          ) -> list[dict[str, Any]]:
    """Validated rows of a path / `datasets` name, or of an in-memory list or Dataset."""
    opts = {"columns": data_columns(cfg, prompt_field) or None, "require": require}
    if isinstance(source, str):
        return load_rows(source, kind=kind, split=split, subset=cfg.data_subset or None,
                         limit=limit, **opts)
    name = f"<in-memory {kind} data>"
    rows = in_memory_rows(source, split, name)  # a DatasetDict's split, a DataFrame's records
    rows = rows[:limit] if limit is not None else rows
    return validate_rows(enumerate(rows, 1), kind, name, **opts)


def build_rewards(rewards: RewardValues, reward_fns: dict[str, Any] | None
                 ) -> tuple[Rewards | None, list[str]]:
    """The rewards of `rewards:` (or of the list under `rewards.key`: `audit_rewards`; None when
    it is empty) and the reward names, in order; `reward_fns`: name -> function given in Python."""
    specs_raw, key = rewards.specs, rewards.key
    if not specs_raw:  # SFT / DPO with `rewards: []`: no greedy held-out scoring
        return None, []
    fns = reward_fns or {}
    try:
        specs = [RewardSpec.from_dict(s, fn=fns.get(s.get("name"))) for s in specs_raw]
    except TypeError as err:
        raise ConfigError(
            f"config key {key!r}: each entry needs name and weight: {err}") from err
    try:
        validate_specs(specs)
    except ValueError as err:
        raise ConfigError(f"config key {key!r}: {err}") from err
    return (Rewards(specs, on_error=rewards.on_error, timeout_s=rewards.timeout_s),
            [s.name for s in specs])


def _needed_fields(fns: Rewards | None, answer_field: str) -> dict[str, str]:
    """Row field -> why it is needed, for every field a reward function requires; `answer` is
    read from `answer_field`, so that is the field every row must carry."""
    need: dict[str, str] = {}
    for name, rewards in (fns.needed_fields() if fns else {}).items():
        why = f"reward {', '.join(map(repr, rewards))} needs it"
        if name == "answer" and answer_field != "answer":
            name, why = answer_field, f"{why} as 'answer': answer_field={answer_field}"
        need[name] = why
    return need


def load_session(cfg: BaseConfig, kind: str, with_train: bool = True, *,
                 loader: Callable[[], tuple[Any, Any]] | None = None, model: Any = None,
                 tokenizer: Any = None, train_data: Any = None, eval_data: Any = None,
                 reward_fns: dict[str, Any] | None = None, place: bool = True,
                 agent: Any = None, values: RunValues | None = None) -> Session:
    """Validate rewards and data (cheap, first), check the rows against the tokenizer and the
    model's context, then load the model.

    `model`, `tokenizer`, `train_data`, `eval_data` and `reward_fns` are in-memory objects from
    the Python API; what is not given is loaded from the config (`loader` loads the model).
    `place`: move the model to `cfg.device` (not under FSDP2, which places each rank's shards).
    `agent`: the run's tools and environments; the rows must name a known environment.
    `values`: the trainer's values beyond `BaseConfig`'s keys (default: `RunValues()`).
    """
    if with_train:
        check_trackers(cfg)
    values = values or RunValues()
    rewards, names = build_rewards(values.rewards, reward_fns)
    if kind == "prompts" and "code" in names:
        kind = "code"  # code rows carry `tests`: validate them before any training starts
    answer_field, field_ = values.rows.answer_field, values.rows.prompt_field
    need = _needed_fields(rewards, answer_field)  # every row carries what the rewards read
    train_rows = (_rows(cfg, field_, train_data if train_data is not None else cfg.train_data,
                        kind, cfg.train_split,
                        require=need if kind in ("prompts", "code") else None)
                  if with_train else [])
    eval_source = eval_data if eval_data is not None else cfg.eval_data
    eval_kind = kind if kind == "code" else "prompts"
    eval_rows = (_rows(cfg, field_, eval_source, eval_kind, cfg.eval_split, cfg.eval_size,
                       need) if eval_source else [])
    marker = values.rows.answer_marker
    if kind == "prompts":
        train_rows = _normalise_rows(train_rows, answer_field, marker)
    eval_rows = _normalise_rows(eval_rows, answer_field, marker)
    try:
        check_environment_rows(agent, train_rows, "train_data")
        check_environment_rows(agent, eval_rows, "eval_data")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if model is None or isinstance(model, str):
        # the tokenizer and the model's config first (cheap): rows are checked against them
        # before the weights load
        early = tokenizer or load_tokenizer(cfg.model)
        session = Session(cfg, None, _with_template(early, cfg), train_rows, eval_rows,
                          values=values)
        _check_tools(session, agent)
        check_rows(session, kind, model_context(cfg.model), _sources(cfg, train_data, eval_data))
        _check_lora(cfg, None)
        model, loaded_tok = (loader or _causal_lm(cfg))()
        tokenizer = tokenizer or loaded_tok
    elif tokenizer is None:
        raise ConfigError("a model object needs its tokenizer: pass tokenizer=...")
    else:
        session = Session(cfg, model, _with_template(tokenizer, cfg), train_rows, eval_rows,
                          values=values)
        _check_tools(session, agent)
        check_rows(session, kind, model_context(model), _sources(cfg, train_data, eval_data))
        _check_lora(cfg, model)
    if place:
        model.to(resolve_device(cfg.device))
    return Session(cfg, model, _with_template(tokenizer, cfg), train_rows, eval_rows, rewards,
                   names, values=values)


def _check_tools(session: Session, agent: Any) -> None:
    """Tools need a chat template that renders their schemas (`tool_schemas`) and a call
    format posttrain reads, whose answers the template renders (`tool_call_parser`)."""
    if agent is not None:
        try:
            check_tool_template(session.tokenizer, session.cfg.chat_template,
                                session.values.tool_schemas)
            check_call_format(session.tokenizer, session.values.tool_call_parser)
        except ValueError as err:
            raise ConfigError(str(err)) from err


def _check_lora(cfg: BaseConfig, model: Any) -> None:
    """`lora_target_modules` against the model's module names (for a path: the model built on
    ``meta`` from its config, no weights read), before the weights load."""
    if cfg.lora_r <= 0:
        return
    if model is None:
        model = load_model_and_tokenizer(cfg.model, dtype=cfg.dtype, empty=True)[0]
    try:
        check_lora_targets(model, cfg.lora_target_modules)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _with_template(tokenizer: Any, cfg: BaseConfig) -> Any:
    """The tokenizer with `chat_template` installed when it is a template string (so the
    trained model is saved with the template it was trained on), rendering every prompt with
    `chat_template_kwargs` (TRL's key: Qwen3's `enable_thinking`)."""
    if cfg.chat_template not in ("auto", "none"):
        tokenizer.chat_template = cfg.chat_template
    kwargs = cfg.chat_template_kwargs
    if kwargs:  # a partial of the class's method pickles with the tokenizer (async sampler)
        tokenizer.apply_chat_template = functools.partial(type(tokenizer).apply_chat_template,
                                                          tokenizer, **kwargs)
    return tokenizer


def _sources(cfg: BaseConfig, train_data: Any, eval_data: Any) -> tuple[str, str]:
    """Names of the train and eval sources for error messages."""
    def name(obj: Any, path: str, what: str) -> str:
        return path if obj is None or isinstance(obj, str) else f"<in-memory {what} data>"

    return (name(train_data, cfg.train_data, "train"), name(eval_data, cfg.eval_data, "eval"))


def check_rows(session: Session, kind: str, context: int | None,
               sources: tuple[str, str]) -> None:
    """Rows against the tokenizer: conversational values need a chat template; RL prompts
    (after rendering, with the system prompt) fit `max_prompt_len` and the model's context
    with `max_new_tokens` (eval prompts with the evaluation budget) to spare; the prompts of
    SFT / preference / outcome / step rows leave a token of the context for their completion
    (whole rows are checked against `max_seq_len` when the trainer tokenizes them)."""
    cfg, tok, gen = session.cfg, session.tokenizer, session.values.generation
    for rows, source in ((session.train_rows, sources[0]), (session.eval_rows, sources[1])):
        check_renderable(tok, rows, source, cfg.chat_template)
    if context and kind not in ("prompts", "code") and session.train_rows:
        check_prompt_lengths(tok, session.train_rows, sources[0],
                             lambda p: render_prompt(tok, p, cfg.chat_template), context - 1,
                             f"the model's context of {context} tokens less one for the "
                             "completion")
    new, budget = gen.max_new_tokens, gen.max_prompt_len
    if new is None:
        return
    if context and budget and budget + new > context:
        raise ConfigError(f"config keys 'max_prompt_len'={budget} + 'max_new_tokens'={new}: "
                          f"{budget + new} tokens, over the model's context of {context}")
    checks = [(session.train_rows if kind in ("prompts", "code") else [], sources[0],
               "max_new_tokens", new, budget),
              (session.eval_rows, sources[1], "eval_max_new_tokens", gen.eval_max_new_tokens, 0)]
    for rows, source, key, n_new, cap in checks:
        if rows and context and n_new >= context:
            raise ConfigError(f"config key '{key}'={n_new}: leaves no room for a prompt in the "
                              f"model's context of {context} tokens")
        limits = [(cap, f"max_prompt_len={cap}")] if cap else []
        if context:
            limits.append((context - n_new, f"the model's context of {context} tokens less "
                                            f"{key}={n_new}"))
        if rows and limits:
            limit, why = min(limits)
            check_prompt_lengths(tok, rows, source, session.render, limit, why)


def _causal_lm(cfg: BaseConfig) -> Callable[[], tuple[Any, Any]]:
    return lambda: load_model_and_tokenizer(cfg.model, dtype=cfg.dtype)
