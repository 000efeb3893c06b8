"""Config loading: recipes + overrides, type checks, clear errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import (
    CONFIGS,
    ConfigError,
    GRPOConfig,
    SFTConfig,
    build_config,
    config_help,
    field_docs,
)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _grpo(**kw):
    base = {"model": "m", "train_data": "d.jsonl"}
    return build_config(GRPOConfig, overrides={**base, **kw})


def test_overrides_parse_as_yaml_and_types_are_checked():
    cfg = build_config(GRPOConfig, overrides=["model=m", "train_data=d", "lr=1e-5",
                                              "group_size=4", "dual_clip=3"])
    assert cfg.lr == pytest.approx(1e-5) and isinstance(cfg.lr, float)
    assert cfg.group_size == 4 and cfg.dual_clip == 3.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"group_sise": 4}, "unknown config key 'group_sise'. Did you mean group_size"),
        ({"group_size": "four"}, "group_size='four': expected an integer"),
        ({"group_size": 1}, "'group_size'=1"),
        ({"loss_agg": "mean"}, "expected one of ['seq-mean-token-mean'"),
        ({"autocast_bf16": "yes"}, "expected true or false"),
        ({"lr": -1.0}, "'lr'=-1.0"),
        ({"mini_batches": 3}, "must divide"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        _grpo(**overrides)
    assert message in str(err.value)


def test_missing_required_model_and_data():
    with pytest.raises(ConfigError, match="'model'"):
        build_config(GRPOConfig, overrides={"train_data": "x"})
    with pytest.raises(ConfigError, match="'train_data'"):
        build_config(SFTConfig, overrides={"model": "x"})


def test_recipe_errors_name_the_file(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("model: m\ntrain_data: d\nclip_eps: 0.2\n")
    with pytest.raises(ConfigError) as err:
        build_config(GRPOConfig, bad)
    assert str(bad) in str(err.value) and "clip_eps" in str(err.value)
    with pytest.raises(ConfigError, match="file not found"):
        build_config(GRPOConfig, tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo", "dr_grpo"])
def test_shipped_grpo_recipes_load(name):
    cfg = build_config(GRPOConfig, RECIPES / f"{name}.yaml")
    assert cfg.group_size >= 2


def test_every_field_is_documented():
    for cls in CONFIGS.values():
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
        assert "group_size" in config_help(GRPOConfig)
