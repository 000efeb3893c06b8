"""The error a run stops with when a function the user gave fails (no posttrain imports)."""

from __future__ import annotations

from typing import ClassVar


class UserFunctionError(RuntimeError):
    """A user's function (a reward, a tool) failed on most of a step's calls, so the run stops:
    the command line prints the message as one line, `posttrain <command>: <kind> error: ...`
    (exit 1), never a traceback. Reward and tool failures subclass it."""

    kind: ClassVar[str] = "function"
    """What failed, as the command line names it."""
