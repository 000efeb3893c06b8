"""The one error type of the config layer."""

from __future__ import annotations


class ConfigError(ValueError):
    """A recipe or override that does not fit the config: names the key and what was expected."""
