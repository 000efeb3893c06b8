"""Values, not config probes, cross into engine/ (issue 60, item 1): no `getattr(cfg, ...)` /
`hasattr(cfg, ...)` under posttrain/engine; each trainer's values carry its config's keys; every
config key declared once, a re-declaration only to change a default."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path
from typing import Any

import pytest

from posttrain.config import BaseConfig
from posttrain.config.preference import DPOConfig, KTOConfig, OnlineDPOConfig
from posttrain.config.rm import PRMConfig, RMConfig
from posttrain.config.sft import SFTConfig
from posttrain.engine.trainer import Trainer
from posttrain.engine.values import RunValues
from posttrain.trainers import TRAINERS, trainer_class

ROOT = Path(__file__).resolve().parents[2]


def config_probes(root: Path) -> list[str]:
    """`getattr` / `hasattr` calls whose object is a config (`cfg`, `self.cfg`, `x.cfg`)."""
    found = []
    for path in sorted((root / "posttrain" / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and ast.unparse(node.args[0]).split(".")[-1] == "cfg"):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_engine_reads_no_config_by_probing() -> None:
    assert config_probes(ROOT) == []


def test_the_probe_count_sees_a_probe(tmp_path: Path) -> None:
    engine = tmp_path / "posttrain" / "engine"
    engine.mkdir(parents=True)
    (engine / "x.py").write_text("def f(self, cfg):\n    a = getattr(cfg, 'k', 1)\n"
                                 "    return getattr(self.cfg, 'j', a), hasattr(cfg, 'k')\n")
    assert len(config_probes(tmp_path)) == 3


CASES = {  # config keys set away from their defaults -> what the trainer's values then hold
    "grpo": ({"prompt_field": "q", "answer_field": "a", "answer_marker": "####",
              "rewards": [{"name": "math", "weight": 1.0}], "reward_on_error": "zero",
              "reward_timeout_s": 5.0, "max_new_tokens": 9, "max_prompt_len": 11,
              "eval_max_new_tokens": 13, "temperature": 0.7, "tool_schemas": "none",
              "tool_call_parser": "hermes", "micro_batch_size": 3},
             lambda v: (v.rows.prompt_field, v.rows.answer_field, v.rows.answer_marker,
                        v.rewards.specs, v.rewards.on_error, v.rewards.timeout_s,
                        v.generation.max_new_tokens, v.generation.max_prompt_len,
                        v.generation.eval_max_new_tokens,
                        v.generation.temperature, v.tool_schemas, v.tool_call_parser,
                        v.micro_batch_size, v.max_len),
             ("q", "a", "####", [{"name": "math", "weight": 1.0}], "zero", 5.0, 9, 11, 13,
              0.7, "none", "hermes", 3, 9)),
    "sft": ({"eval_max_new_tokens": 7, "max_seq_len": 99, "micro_batch_size": 5,
             "eval_rewards": []},
            lambda v: (v.generation.max_new_tokens, v.generation.eval_max_new_tokens,
                       v.rewards.specs, v.micro_batch_size, v.max_len),
            (7, 7, [], 5, 99)),
    "rm": ({"max_seq_len": 77, "micro_batch_size": 4},
           lambda v: (v.generation.max_new_tokens, v.rewards.specs, v.micro_batch_size,
                      v.max_len), (None, [], 4, 77)),
}


@pytest.mark.parametrize("command", sorted(CASES))
def test_values_carry_the_configs_keys(command: str) -> None:
    keys, read, expected = CASES[command]
    cls = trainer_class(command)
    assert read(cls.run_values(cls.config_class(**keys))) == expected


@pytest.mark.parametrize("command", sorted(TRAINERS))
def test_every_trainer_whose_config_has_more_keys_builds_values(command: str) -> None:
    """A trainer whose config has keys the values read (`max_new_tokens`,
    `eval_max_new_tokens`, `max_seq_len`, `rewards`, `eval_rewards`) builds its own values;
    only a bare config leaves the defaults."""
    cls = trainer_class(command)
    names = {f.name for f in dataclasses.fields(cls.config_class)}
    if names & {"max_new_tokens", "eval_max_new_tokens", "max_seq_len", "rewards",
                 "eval_rewards"}:
        assert cls.run_values is not Trainer.run_values, command
        assert isinstance(cls.run_values(cls.config_class()), RunValues)


@pytest.mark.parametrize("cfg", [SFTConfig(), DPOConfig(), KTOConfig(), OnlineDPOConfig(),
                                 RMConfig(), PRMConfig()], ids=lambda c: type(c).__name__)
def test_values_of_each_config_at_its_defaults(cfg: BaseConfig) -> None:
    """What engine/ used to read by probing, at the defaults: the evaluation budget is
    `eval_max_new_tokens` in every config that evaluates by generating, else 64."""
    command = {"SFTConfig": "sft", "DPOConfig": "dpo", "KTOConfig": "kto",
               "OnlineDPOConfig": "online_dpo", "RMConfig": "rm", "PRMConfig": "prm"}
    v = trainer_class(command[type(cfg).__name__]).run_values(cfg)
    probe = getattr(cfg, "eval_max_new_tokens", 64)
    assert v.generation.eval_max_new_tokens == probe
    assert v.generation.temperature == getattr(cfg, "temperature", 1.0)
    assert v.max_len == (getattr(cfg, "max_seq_len", None) or getattr(cfg, "max_new_tokens",
                                                                      None))
    assert v.rewards.specs == getattr(cfg, "eval_rewards", getattr(cfg, "rewards", []))


# ---- every config key declared once; a re-declaration only to change a default ----------------
TWO_THINGS: dict[str, tuple[str, ...]] = {}  # one key name, two different things: none left


def config_classes() -> list[type]:
    """Every dataclass defined in posttrain/config/*.py."""
    found = []
    for path in sorted((ROOT / "posttrain" / "config").glob("*.py")):
        module = importlib.import_module(f"posttrain.config.{path.stem}")
        found += [c for c in vars(module).values() if isinstance(c, type)
                  and dataclasses.is_dataclass(c) and c.__module__ == module.__name__]
    return found


def _default(cls: type, key: str) -> Any:
    f = cls.__dataclass_fields__[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def declarations() -> tuple[dict[str, list[str]], list[tuple[str, str, Any, Any]]]:
    """(key -> the classes declaring it first, [(class, key, its default, the inherited one)])
    over the config classes; ClassVars are not keys."""
    homes: dict[str, list[str]] = {}
    again = []
    for cls in config_classes():
        for key, tp in vars(cls).get("__annotations__", {}).items():
            if "ClassVar" in str(tp):
                continue
            base = next((b for b in cls.__mro__[1:] if key in getattr(
                b, "__dataclass_fields__", {})), None)
            if base is None:
                homes.setdefault(key, []).append(cls.__name__)
            else:
                again.append((cls.__name__, key, _default(cls, key), _default(base, key)))
    return homes, again


def test_every_config_key_is_declared_once() -> None:
    homes, _ = declarations()
    twice = {key: tuple(sorted(names)) for key, names in homes.items() if len(names) > 1}
    assert twice == TWO_THINGS


def test_a_redeclaration_only_changes_a_default() -> None:
    _, again = declarations()
    assert ("SFTConfig", "lr", 1e-3, 1e-5) in again  # the list is read
    same = [(cls, key, new) for cls, key, new, old in again if new == old]
    assert same == []
