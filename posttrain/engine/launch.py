"""What building and running a trainer needs besides the loop (`posttrain.engine.trainer`).

The Python API's keyword arguments turned into a config plus in-memory objects, the feature
checks made before any model loads, activation checkpointing, and the SIGTERM / SIGINT
request that the loop polls between phases.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from posttrain.config import BaseConfig, ConfigError, build_config, to_dict
from posttrain.core.lock import OutDirBusy, OutDirLock
from posttrain.engine.checkpoint import list_checkpoints


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


# what an earlier run leaves in out_dir: its presence refuses a fresh run; `overwrite` clears it
RUN_MARKERS = ("metrics.jsonl", "checkpoints")
RUN_FILES = (*RUN_MARKERS, "summary.json", "reward_errors.jsonl", "completions.jsonl", "tb")
IGNORED_CHANGES = ("resume_from", "overwrite")


def prepare_out_dir(cfg: BaseConfig, is_main: bool, name: str = "train") -> OutDirLock | None:
    """Lock `out_dir` for this run (rank 0; a second run there is refused), then refuse a fresh
    run into an `out_dir` holding an earlier one (it would append to its metrics.jsonl, and a
    later `resume_from: latest` would resume the older run), unless `resume_from` is set; with
    `overwrite: true`, or `resume_from: latest` and no checkpoint to resume (said on stderr),
    rank 0 deletes the earlier run's files. Returns the lock (None on other ranks)."""
    lock = None
    if is_main:
        try:
            lock = OutDirLock.acquire(cfg.out_dir)
        except OutDirBusy as err:
            raise ConfigError(f"config key 'out_dir'={cfg.out_dir!r}: {err}") from None
    out = Path(cfg.out_dir)
    found = [name for name in RUN_MARKERS if _holds_data(out / name)]
    nothing = cfg.resume_from == "latest" and not list_checkpoints(out)
    if nothing and is_main:
        print(f"[{name}] resume_from: latest: nothing to resume (no checkpoint in "
              f"{out / 'checkpoints'}), starting fresh"
              + (f"; the earlier run's {', '.join(found)} replaced" if found else ""),
              file=sys.stderr)
    if not found or (cfg.resume_from and not nothing):
        return lock
    if not (cfg.overwrite or nothing):
        if lock is not None:
            lock.release()
        raise ConfigError(f"config key 'out_dir'={cfg.out_dir!r}: holds an earlier run "
                          f"({', '.join(found)}); set resume_from: latest to continue it, "
                          "overwrite: true to replace it, or choose another out_dir")
    if is_main:
        for name_ in RUN_FILES:
            path = out / name_
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    return lock


def _holds_data(path: Path) -> bool:
    """A non-empty file, or a directory with an entry (a trainer made but never trained leaves
    an empty metrics.jsonl: not a run)."""
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


def config_changes(out_dir: str | Path, cfg: BaseConfig) -> list[str]:
    """`key: old -> new` for each config key whose value differs from the earlier run's
    `out_dir/config.yaml` (none when it is missing or unreadable)."""
    import yaml

    path = Path(out_dir) / "config.yaml"
    try:
        old = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    new = to_dict(cfg)
    return [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items()
            if k not in IGNORED_CHANGES and k in old and old[k] != v]


def report_resume(name: str, step: int, changes: list[str]) -> None:
    """'resumed from step N' on stderr, with the config keys changed since that run."""
    print(f"[{name}] resumed from step {step}", file=sys.stderr)
    if changes:
        print(f"[{name}] config keys changed since the checkpointed run: {'; '.join(changes)}",
              file=sys.stderr)


def check_warmup(cfg: BaseConfig, total: int, name: str) -> None:
    """A warning when warm-up lasts the whole run: the learning rate never reaches `lr`."""
    if cfg.warmup_steps and cfg.warmup_steps >= total:
        print(f"[{name}] warning: config key 'warmup_steps'={cfg.warmup_steps} >= the run's "
              f"{total} optimizer steps: warm-up lasts the whole run, the learning rate reaches "
              f"{total / cfg.warmup_steps:.0%} of lr={cfg.lr:g} at the last step only; lower "
              "warmup_steps (TRL's default is 0)", file=sys.stderr)


def report_stop(name: str, step: int, max_steps: int, out_dir: str) -> None:
    """The one line a run stopped by SIGTERM / SIGINT prints: no `final/` was written."""
    print(f"[{name}] warning: stopped by a signal at step {step} of {max_steps}: a checkpoint "
          f"is in {out_dir}/checkpoints but there is NO {out_dir}/final; the summary has "
          "stopped_at_step; resume_from: latest continues the run", file=sys.stderr)
