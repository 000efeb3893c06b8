"""The one error type of the config layer, and the one way a table of checks raises it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A recipe or override that does not fit the config: names the key and what was expected."""


def check_table(cfg: Any, checks: dict[str, tuple[bool, str]]) -> None:
    """Raise `ConfigError` for the first key whose check fails, naming it and its value."""
    for key, (ok, msg) in checks.items():
        if not ok:
            raise ConfigError(f"config key '{key}'={getattr(cfg, key, None)!r}: {msg}")
