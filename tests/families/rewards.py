"""A reward for the real-family runs (loaded by "module:function", like a user's): the share of
ASCII characters in a completion, which varies across the samples of an untrained model (the
math reward alone is 0 for all of them, so GRPO's advantages would all be 0)."""


def ascii_share(completion: str) -> float:
    return sum(ch.isascii() for ch in completion) / max(len(completion), 1)
