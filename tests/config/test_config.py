"""Config loading: recipes + overrides, type checks, clear errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import (
    ConfigError,
    GRPOConfig,
    SFTConfig,
    build_config,
    config_help,
    field_docs,
)
from posttrain.trainers import TRAINERS, config_class

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


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


# what makes each preset the paper's algorithm (the values its header cites)
PRESET_KEYS = {
    "grpo": {"advantage": "grpo", "ratio_level": "token", "kl_placement": "loss",
             "kl_estimator": "k3", "loss_agg": "seq-mean-token-mean"},
    "gspo": {"ratio_level": "sequence", "sequence_ratio": "geometric", "clip_eps_low": 3e-4,
             "clip_eps_high": 4e-4},
    "dapo": {"clip_eps_high": 0.28, "dynamic_sampling": True, "loss_agg": "token-mean",
             "mask_truncated_completions": True, "kl_coef": 0.0},
    "dr_grpo": {"scale": "none", "loss_agg": "seq-mean-token-sum-norm"},
}


@pytest.mark.parametrize("name", sorted(PRESET_KEYS))
def test_shipped_grpo_recipes_load_as_their_paper_presets(name):
    cfg = build_config(GRPOConfig, RECIPES / f"{name}.yaml")
    assert {k: getattr(cfg, k) for k in PRESET_KEYS[name]} == PRESET_KEYS[name]


def test_every_field_is_documented():
    for cls in [config_class(c) for c in TRAINERS]:
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"
        assert "group_size" in config_help(GRPOConfig)
