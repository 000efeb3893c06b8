"""Exceptions shared by the reward functions and the scorer."""

from __future__ import annotations


class UnscorableError(ValueError):
    """The sample cannot be scored (e.g. its gold answer does not parse).

    The scorer excludes such a sample (score ``nan``) and counts it under
    ``reward/unscorable``; it is never turned into a silent 0.
    """


class SandboxUnavailableError(RuntimeError):
    """The requested sandbox mode cannot run here (e.g. ``strict`` without bubblewrap)."""


class RewardFunctionError(RuntimeError):
    """A reward function raised; carries the function name and sample index."""

    def __init__(self, name: str, index: int, exc: BaseException) -> None:
        super().__init__(f"reward function {name!r} failed on sample {index}: {exc!r}")
        self.name = name
        self.index = index
