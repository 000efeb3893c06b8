"""Command line: ``posttrain <command> --config recipe.yaml [key=value ...]``, ``posttrain demo``.

Each training command validates the whole config and data before loading a model, trains or
evaluates, and writes ``<out_dir>/summary.json`` (eval_before, eval_after, seconds, peak_rss_mb).
``posttrain <command> --help`` lists every config key with its documentation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from posttrain.config import ConfigError, build_config, config_help
from posttrain.trainers import TRAINERS, config_class, train

# TRL's trainers that are a setting of one of ours: `posttrain cpo` -> what to run instead
TRL_COMMANDS = {"cpo": "posttrain dpo loss_type=simpo (CPO's NLL term: rpo_alpha)",
                "simpo": "posttrain dpo loss_type=simpo", "rloo": "posttrain grpo advantage=rloo",
                "async_grpo": "posttrain grpo async_rollouts=true (docs/async.md)"}
COMMANDS: dict[str, str] = {
    **{name: text for name, (_, text) in TRAINERS.items()},
    "eval": "greedy held-out evaluation of a model with reward functions",
    "search": "test-time search: best-of-N, (weighted) majority vote, PRM beam search",
    "audit": "run a reward over known exploits before training on it (exit 1 on one)",
}


def _runner(command: str) -> Callable[[Any], dict[str, Any]]:
    if command == "search":
        from posttrain.engine.preflight import preflight
        from posttrain.search.command import run_search

        return lambda cfg: (preflight(cfg), run_search(cfg))[1]  # device checks, then search
    if command == "eval":
        from posttrain.engine.eval_command import run_eval

        return run_eval
    return lambda cfg: train(command, cfg)


def _config_command(command: str, argv: list[str]) -> int:
    from posttrain.engine.sampler_start import close_early, start_early

    start_early(command, argv)  # async_rollouts: its imports beside the trainer's (docs/async.md)
    try:
        return _run_command(command, argv)
    finally:
        close_early()  # not taken: the run stopped before its trainer started


def _run_command(command: str, argv: list[str]) -> int:
    cfg_cls = config_class(command)
    parser = argparse.ArgumentParser(
        prog=f"posttrain {command}", description=COMMANDS[command],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (set in the recipe or as key=value):\n" + config_help(cfg_cls))
    parser.add_argument("--config", help="YAML recipe", default=None)
    parser.add_argument("overrides", nargs="*", help="key=value overrides (values are YAML)")
    if (hint := _option_hint(argv)) is not None:
        print(f"posttrain {command}: {hint}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if command == "eval" and not any(o.startswith("train_data=") for o in overrides):
        # eval reads eval_data; train_data is only required by the trainers
        overrides.append("train_data=__unused__")
    from posttrain.core.errors import UserFunctionError
    from posttrain.engine.async_rollout import SamplerDied
    from posttrain.engine.distributed import close_process_group
    from posttrain.engine.push_check import PushCheckError
    from posttrain.models.loading import ModelLoadError
    from posttrain.rollout.vllm_server import ServerError

    finished = False
    try:
        cfg = build_config(cfg_cls, args.config, overrides)
        summary = _runner(command)(cfg)
        finished = True
    except ConfigError as err:
        print(f"posttrain {command}: config error: {err}", file=sys.stderr)
        return 2
    except _data_error() as err:
        print(f"posttrain {command}: data error: {err}", file=sys.stderr)
        return 2
    except ModelLoadError as err:
        print(f"posttrain {command}: model error: {' '.join(str(err).split())}",
              file=sys.stderr)
        return 2
    except UserFunctionError as err:  # a broken reward or tool stopped the run (docs/rewards.md)
        print(f"posttrain {command}: {err.kind} error: {err}", file=sys.stderr)
        return 1
    except SamplerDied as err:  # async_rollouts: the sampler process died or raised
        print(f"posttrain {command}: sampler error: {err}", file=sys.stderr)
        return 1
    except (ServerError, PushCheckError) as err:  # a vLLM server stopped or a push missed
        print(f"posttrain {command}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    finally:
        close_process_group(finished)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return 0
    keys = ("eval_before", "eval_after", "accuracy", "seconds", "stopped_at_step")
    short = {k: summary.get(k) for k in keys if k in summary}
    if "methods" in summary:  # search: accuracy and tokens of every method
        short["methods"] = summary["methods"]
    print(json.dumps(short))
    print(f"wrote {cfg.out_dir}/summary.json")
    return 0


def _option_hint(argv: list[str]) -> str | None:
    """argparse-style `--max_steps 10` named with the form posttrain takes: `max_steps=10`
    (None when every option is one of ours)."""
    options, forms, rest = [], [], list(argv)
    while rest:
        item = rest.pop(0)
        key, sep, value = item.partition("=")
        if not item.startswith("--") or key in ("--config", "--help"):
            if item == "--config" and rest:
                rest.pop(0)
            continue
        if not sep and rest and not rest[0].startswith("-") and "=" not in rest[0]:
            value = rest.pop(0)
        options.append(item)
        forms.append(f"{key[2:].replace('-', '_')}={value}")
    if not options:
        return None
    return (f"unrecognized option(s) {' '.join(options)}: config keys are given as key=value, "
            f"not --key value: {' '.join(forms)}")


def _accelerate_warning() -> str | None:
    """A warning when `accelerate launch` started this process without torchrun's environment:
    posttrain reads no accelerate config, so `--num_processes 2` would silently run one."""
    launched = any(k in os.environ for k in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU"))
    if not launched or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # (its launcher sets these)
        return None
    return ("posttrain: warning: started by `accelerate launch`, which posttrain does not use: "
            "this is one process; for N processes run `torchrun --nproc_per_node N -m posttrain "
            "<command> ...` (docs/distributed.md)")


def _data_error() -> type[Exception]:
    from posttrain.data import DataError

    return DataError


def _demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="posttrain demo",
        description="Offline end-to-end run on the built-in arithmetic task: build a tokenizer "
        "and a tiny Llama, SFT warm start on flawed traces, GRPO with a verifiable reward, "
        "before/after table, curves PNG and summary.json.")
    parser.add_argument("--out", default="runs/demo", help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--quick", action="store_true",
                        help="a much shorter run (smoke test; no accuracy claim)")
    args = parser.parse_args(argv)
    from posttrain.core.io import RunStopped
    from posttrain.demo import run_demo

    try:
        run_demo(args.out, seed=args.seed, quick=args.quick)
    except RunStopped as err:
        print(f"posttrain demo: {err}", file=sys.stderr)
        return 1
    return 0


def _quiet_libraries() -> None:
    """Our own progress bar and table are the output; hide transformers' per-file bars."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def _import_from_cwd() -> None:
    """Let `pkg.module:function` rewards import from the working directory, as under
    ``python -m posttrain`` (which puts it first on ``sys.path``; the installed ``posttrain``
    script puts its own bin directory there instead)."""
    cwd = os.getcwd()
    if not any(p in ("", ".", cwd) for p in sys.path):
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _import_from_cwd()
    _quiet_libraries()
    usage = ("usage: posttrain {demo,vllm-serve," + ",".join(COMMANDS)
             + "} [--config recipe.yaml] [k=v ...]")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        print("  demo: offline end-to-end GRPO run on the built-in arithmetic task")
        print("  vllm-serve: start `vllm serve MODEL` for rollout_engine=vllm_server")
        for name, text in COMMANDS.items():
            print(f"  {name}: {text}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if (warning := _accelerate_warning()) is not None:
        print(warning, file=sys.stderr)
    if command == "demo":
        return _demo(rest)
    if command == "vllm-serve":  # flags, like demo; the process becomes the server
        from posttrain.rollout.vllm_serve import main as serve

        return serve(rest)
    if command == "audit":  # not a config command: flags, like demo
        from posttrain.rewards.audit import audit_command

        return audit_command(rest)
    if command not in COMMANDS:
        trl = f" (TRL's trainer: run {TRL_COMMANDS[command]})" if command in TRL_COMMANDS else ""
        print(f"posttrain: unknown command '{command}'{trl}\n{usage}", file=sys.stderr)
        return 2
    return _config_command(command, rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
