"""Reward functions for the toy GRPO tests (loaded by "module:function", like a user's)."""

import os
import time
from pathlib import Path

_CALLS = [0]


def sevens(completion: str) -> float:
    """Fraction of the first 8 characters that are '7': rises as the policy learns.

    Crash tests: with `TOY_HANG_AT_CALL=n` the n-th call writes the file `TOY_HANG_MARKER` and
    sleeps, so the test can `kill -9` the run in the middle of a step.
    """
    _CALLS[0] += 1
    if os.environ.get("TOY_HANG_AT_CALL") == str(_CALLS[0]):
        Path(os.environ["TOY_HANG_MARKER"]).write_text("hanging")
        time.sleep(600)
    head = completion[:8]
    return sum(ch == "7" for ch in head) / 8.0


def digits(completion: str) -> float:
    """Fraction of the first 8 characters that are digits: non-zero for some samples of an
    untrained character model (about 1 character in 10), unlike `sevens` (1 in 100)."""
    return sum(ch.isdigit() for ch in completion[:8]) / 8.0


def crash_on_a(completion: str) -> float:
    """Raises on completions containing 'a' (tests error counting), else 1.0."""
    if "a" in completion:
        raise RuntimeError("reward function crashed on purpose")
    return 1.0


def always_one(completion: str) -> float:
    """A custom reward that says nothing about correctness: 1.0 for every sample."""
    return 1.0


async def digits_async(completion: str) -> float:
    """`digits` as an `async def` reward (TRL's async reward functions): awaited by the scorer."""
    import asyncio

    await asyncio.sleep(0.001)
    return digits(completion)


def not_digits(completion: str) -> float:
    """1 - `digits`: a held-out check that disagrees with `digits` (the tripwire's audit)."""
    return 1.0 - digits(completion)
