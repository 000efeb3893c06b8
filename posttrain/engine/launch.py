"""What starting a trainer needs besides the loop (`posttrain.engine.trainer`) and its output
directory (`posttrain.engine.out_dir`): the Python API's keyword arguments turned into a config
plus in-memory objects, the warm-up check, activation checkpointing, and the SIGTERM / SIGINT
request that the loop polls between phases.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from posttrain.config import BaseConfig, ConfigError, build_config


class StopRequest:
    """Record SIGTERM / SIGINT instead of dying, so the loop can checkpoint and return.

    A second SIGINT (Ctrl-C twice) interrupts at once. Only installed in the main thread.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum

    def __enter__(self) -> StopRequest:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


_IN_MEMORY = "<in-memory>"


def resolve_config(cls: type[BaseConfig], cfg: BaseConfig | None, model: Any, tokenizer: Any,
                    train_data: Any, eval_data: Any, rewards: list[Any] | None,
                    keys: dict[str, Any]) -> tuple[BaseConfig, dict[str, Any]]:
    """Config + in-memory objects from the Python API's keyword arguments.

    Strings (paths, names) go into the config; objects (a model, row lists, datasets, reward
    callables) are handed to the session as they are. With a config object (TRL's
    ``GRPOTrainer(GRPOConfig(...), model=m, ...)``), the objects and any config keys given
    beside it are applied on top of it, checked like overrides.
    """
    objects: dict[str, Any] = {}
    values = dict(keys)
    for key, value in (("model", model), ("train_data", train_data), ("eval_data", eval_data)):
        if value is None:
            continue
        if isinstance(value, str):
            values[key] = value
        else:
            values[key] = getattr(value, "name_or_path", "") or _IN_MEMORY
            objects[key] = value
    if tokenizer is not None:
        objects["tokenizer"] = tokenizer
    # `rewards=` is the trainer's reward functions: SFT / DPO / KTO score held-out samples only
    key = "eval_rewards" if "eval_rewards" in cls.__dataclass_fields__ else "rewards"
    given = rewards if rewards is not None else values.get(key)
    if isinstance(given, list):
        specs, fns = _reward_specs(given)
        values[key] = specs
        if fns:
            objects["reward_fns"] = fns
    if cfg is not None:
        if not isinstance(cfg, cls):
            raise ConfigError(f"this trainer takes a {cls.__name__}, got a "
                              f"{type(cfg).__name__}")
        if not values:  # the object itself (callers may hold it), with the keys a run needs
            from posttrain.config import validate_config

            validate_config(cfg)
            return cfg, objects
        return build_config(cls, overrides=values, base=cfg), objects
    return build_config(cls, overrides=values), objects


def _reward_specs(rewards: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Reward entries as config dicts, plus the callables among them by name."""
    specs, fns = [], {}
    for r in rewards:
        if callable(r):
            name = getattr(r, "__name__", f"reward_{len(specs)}")
            specs.append({"name": name, "weight": 1.0})
            fns[name] = r
        elif isinstance(r, str):
            specs.append({"name": r, "weight": 1.0})
        else:
            specs.append(dict(r))
    return specs, fns


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers 5 name, or
    the 4.x ``gradient_checkpointing_enable``); it only acts in training mode."""
    kwargs = {"use_reentrant": False}
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def check_warmup(cfg: BaseConfig, total: int, name: str) -> None:
    """A warning when warm-up lasts the whole run: the learning rate never reaches `lr`."""
    if cfg.warmup_steps and cfg.warmup_steps >= total:
        print(f"[{name}] warning: config key 'warmup_steps'={cfg.warmup_steps} >= the run's "
              f"{total} optimizer steps: warm-up lasts the whole run, the learning rate reaches "
              f"{total / cfg.warmup_steps:.0%} of lr={cfg.lr:g} at the last step only; lower "
              "warmup_steps (TRL's default is 0)", file=sys.stderr)
