"""Config checks added for issues 22 and 24: kl_clamp, dtype, TRL names, config objects."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, GRPOConfig, PPOConfig, build_config


def _build(cls, **kw):
    return build_config(cls, overrides={"model": "m", "train_data": "d.jsonl", **kw})


@pytest.mark.parametrize("cls", [GRPOConfig, PPOConfig])
def test_kl_clamp_default_and_range(cls):
    assert _build(cls).kl_clamp == 10.0
    assert _build(cls, kl_clamp=0).kl_clamp == 0.0
    with pytest.raises(ConfigError, match="'kl_clamp'=-1.0"):
        _build(cls, kl_clamp=-1)
