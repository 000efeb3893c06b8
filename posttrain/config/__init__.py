"""Trainer configs: one dataclass per trainer, every field documented by the string under it.

``posttrain <command> --help`` prints those strings. ``build_config`` reads a YAML recipe plus
``key=value`` overrides; an unknown key, a wrong type or a value outside a field's choices is a
:class:`ConfigError` naming the key (and the file) before any model is loaded.
"""

from posttrain.config.base import (
    TRACKERS,
    BaseConfig,
    ConfigError,
    build_config,
    config_help,
    field_docs,
    math_and_format,
    parse_overrides,
    to_dict,
    validate_config,
)
from posttrain.config.grpo import GRPOConfig
from posttrain.config.ppo import PPOConfig
from posttrain.config.preference import DPOConfig
from posttrain.config.rm import PRMConfig, RMConfig
from posttrain.config.search import SearchConfig
from posttrain.config.sft import SFTConfig

__all__ = ["TRACKERS", "BaseConfig", "ConfigError", "DPOConfig", "GRPOConfig",
           "PPOConfig", "PRMConfig", "RMConfig", "SFTConfig", "SearchConfig",
           "build_config",
           "config_help", "field_docs", "math_and_format", "parse_overrides", "to_dict",
           "validate_config"]
