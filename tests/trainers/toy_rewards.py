"""Reward functions for the toy GRPO tests (loaded by "module:function", like a user's)."""


def sevens(completion: str) -> float:
    """Fraction of the first 8 characters that are '7': rises as the policy learns."""
    head = completion[:8]
    return sum(ch == "7" for ch in head) / 8.0


def crash_on_a(completion: str) -> float:
    """Raises on completions containing 'a' (tests error counting), else 1.0."""
    if "a" in completion:
        raise RuntimeError("reward function crashed on purpose")
    return 1.0
