"""Exceptions shared by the reward functions and `Rewards` (their weighted sum)."""

from __future__ import annotations

from posttrain.core.errors import UserFunctionError


class UnscorableError(ValueError):
    """The sample cannot be scored (e.g. its gold answer does not parse).

    `Rewards` excludes such a sample (score ``nan``) and counts it under
    ``reward/unscorable``; it is never turned into a silent 0.
    """


class RewardFunctionError(UserFunctionError):
    """A reward function raised; carries the function name, the sample index and its completion.

    The message is one line: the function, the sample, the error and the completion's first
    200 characters (``repr``, so newlines stay escaped), plus an optional note.
    """

    kind = "reward"

    def __init__(self, name: str, index: int, exc: BaseException,
                 completion: str | None = None, note: str = "") -> None:
        sample = "" if completion is None else f"; completion: {completion[:200]!r}"
        tail = f" ({note})" if note else ""
        super().__init__(f"reward function {name!r} failed on sample {index}: {exc!r}"
                         f"{sample}{tail}")
        self.name = name
        self.index = index
        self.completion = completion
        self._args = (name, index, exc, completion, note)

    def __reduce__(self) -> tuple:  # crosses process pools with its message intact
        return type(self), self._args
