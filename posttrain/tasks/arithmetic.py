"""Multi-step integer arithmetic: the offline demo task.

A problem is a chain of 2-4 operations of ``+ - *`` on small non-negative integers, written
without spaces, e.g. ``12+7*3-5``. It is evaluated strictly LEFT TO RIGHT, one operation at a
time (no operator precedence): ``12+7*3-5 = ((12+7)*3)-5 = 52``. The reference trace shows every
step::

    <think>12+7=19; 19*3=57; 57-5=52</think><answer>52</answer>

Sampling: the number of operations is uniform in ``[min_ops, max_ops]``, operators are drawn with
weights ``+`` 1/4, ``-`` 1/2, ``*`` 1/4 (subtraction twice as often, for more negative results),
operands of ``+``/``-`` (and the first number) are uniform in ``0..20`` and
multipliers in ``2..5``. A problem is resampled when any intermediate value, of the true chain or
of the sign-dropping chain below, leaves ``[-bound, bound]`` (bound 60), so a tiny character model
only ever sees short numbers (rejection makes long chains a bit rarer: about 38% / 34% / 28%
of problems have 2 / 3 / 4 operations). The space holds 81,551,073 distinct problems
(:func:`space_size` counts them exactly); about 49% of sampled problems have a negative
intermediate result (41% / 52% / 58% for 2 / 3 / 4 operations).

Difficulty (the ``difficulty`` keyword of every generator; ``"easy"``, the default, is all of the
above): ``"hard"`` draws exactly 4 operations, multipliers in ``2..9`` and bound 99, with the
same operators, ``0..20`` operands and step format, so exact step labels work unchanged
(100,617,369 distinct problems; about 16% have a value beyond 60 and 56% a negative one). It
keeps 4 operations because the demo's SFT model (trained on 2-4) writes at most 4 steps: on 5-7
operation problems (easy ranges otherwise) its pass@64 was 11%. On 100 held-out problems
(seed 0) that model's greedy accuracy was 25% hard against 64% easy, and pass@64 69% against
97% (temperature 1, up to 64 new tokens; ``benchmarks/claims.py --split hard`` measures it per
seed). Hard problems draw from random streams of their own (:func:`stream_key`), so the easy
rows of a seed are the same with or without them.

Held-out split: a problem is held out when a hash of its canonical text falls in the first 5% of
the hash range. Training generators never emit a held-out problem, so held-out accuracy measures
generalization, not memorization.

Error injection for imperfect SFT data and process labels:

* ``error_rate``: each step's result is replaced, with this probability, by a wrong value (the
  true result plus a non-zero offset in ``-5..5``); the chain continues from the wrong value.
* ``flaw_rate``: a *systematic* flaw. On this fraction of traces every negative intermediate
  result is written without its minus sign and the chain continues from that wrong value, final
  answer included, so the trace is self-consistent but wrong. Greedy decoding of a model imitating
  such data adopts the majority behaviour on problems with negative intermediates, while
  sampling still writes the sign some of the time: exactly what a verifier-driven RL step can
  fix ("RL corrects what imitation taught wrong").

Step labels are exact: step ``i`` is labelled 1 when its written result equals the true value of
the problem prefix up to that step, else -1 (so every step after a first error is -1 unless the
chain happens to recover), as in outcome-supervised process labels (Math-Shepherd style).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

OPS: tuple[str, ...] = ("+", "-", "*")
_OP_DRAW: tuple[str, ...] = ("+", "-", "-", "*")  # subtraction drawn with weight 1/2
ADD_RANGE: tuple[int, int] = (0, 20)
MUL_RANGE: tuple[int, int] = (2, 5)
BOUND: int = 60
MIN_OPS: int = 2
MAX_OPS: int = 4
HELDOUT_FRACTION: float = 0.05
_HASH_BUCKETS = 10_000
_PROBLEM_RE = re.compile(r"^\d+(?:[+\-*]\d+)+$")
_TOKEN_RE = re.compile(r"\d+|[+\-*]")


@dataclass(frozen=True)
class Difficulty:
    """The sampler's ranges: operations per problem, operand ranges, bound on every value."""

    min_ops: int
    max_ops: int
    add_range: tuple[int, int]  # the first number and the operands of + and -
    mul_range: tuple[int, int]  # multipliers
    bound: int  # every intermediate value (true and sign-dropped chains) within +-bound


DIFFICULTIES: dict[str, Difficulty] = {
    "easy": Difficulty(MIN_OPS, MAX_OPS, ADD_RANGE, MUL_RANGE, BOUND),
    "hard": Difficulty(4, 4, (0, 20), (2, 9), 99),
}


def difficulty_of(difficulty: str | Difficulty) -> Difficulty:
    """A :data:`DIFFICULTIES` name (``"easy"``, ``"hard"``) or a :class:`Difficulty` itself."""
    if isinstance(difficulty, Difficulty):
        return difficulty
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; valid: {list(DIFFICULTIES)}")
    return DIFFICULTIES[difficulty]


@dataclass(frozen=True)
class Problem:
    """A left-to-right arithmetic chain: ``operands[0] ops[0] operands[1] ops[1] ...``."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def text(self) -> str:
        """Canonical problem string, e.g. ``12+7*3-5``."""
        parts = [str(self.operands[0])]
        for op, b in zip(self.ops, self.operands[1:], strict=True):
            parts.append(f"{op}{b}")
        return "".join(parts)

    @property
    def values(self) -> tuple[int, ...]:
        """True intermediate results, one per operation (the last is the answer)."""
        return _chain(self, drop_sign=False)

    @property
    def answer(self) -> int:
        return self.values[-1]

    @property
    def has_negative(self) -> bool:
        """True when any true intermediate result (answer included) is negative."""
        return any(v < 0 for v in self.values)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; valid: {list(OPS)}")


def _chain(problem: Problem, drop_sign: bool) -> tuple[int, ...]:
    """Left-to-right results; with ``drop_sign`` every negative result loses its sign."""
    value = problem.operands[0]
    out = []
    for op, b in zip(problem.ops, problem.operands[1:], strict=True):
        value = _apply(value, op, b)
        if drop_sign:
            value = abs(value)
        out.append(value)
    return tuple(out)


def parse_problem(text: str) -> Problem:
    """Parse a canonical problem string (``12+7*3-5``) back into a :class:`Problem`."""
    if not _PROBLEM_RE.match(text):
        raise ValueError(f"not an arithmetic problem: {text!r} (expected e.g. '12+7*3-5')")
    tokens = _TOKEN_RE.findall(text)
    return Problem(operands=tuple(int(t) for t in tokens[0::2]), ops=tuple(tokens[1::2]))


def is_heldout(problem: Problem | str) -> bool:
    """True when the problem belongs to the fixed held-out split (hash of its canonical text)."""
    text = problem if isinstance(problem, str) else problem.text
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _HASH_BUCKETS < HELDOUT_FRACTION * _HASH_BUCKETS


def _in_bound(problem: Problem, bound: int) -> bool:
    chains = (_chain(problem, drop_sign=False), _chain(problem, drop_sign=True))
    return all(abs(v) <= bound for chain in chains for v in chain)


def sample_problem(
    rng: random.Random,
    *,
    min_ops: int | None = None,
    max_ops: int | None = None,
    split: str | None = "train",
    bound: int | None = None,
    difficulty: str | Difficulty = "easy",
) -> Problem:
    """Draw one problem. ``split`` is ``"train"``, ``"heldout"`` or ``None`` (either).

    ``difficulty`` (a :data:`DIFFICULTIES` name or a :class:`Difficulty`) sets the ranges;
    ``min_ops``, ``max_ops`` and ``bound``, when given, override its own."""
    if split not in ("train", "heldout", None):
        raise ValueError(f"unknown split {split!r}; valid: ['train', 'heldout', None]")
    d = difficulty_of(difficulty)
    min_ops = d.min_ops if min_ops is None else min_ops
    max_ops = d.max_ops if max_ops is None else max_ops
    bound = d.bound if bound is None else bound
    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={min_ops} max_ops={max_ops}")
    while True:
        n_ops = rng.randint(min_ops, max_ops)
        ops = tuple(rng.choice(_OP_DRAW) for _ in range(n_ops))
        operands = [rng.randint(*d.add_range)]
        operands += [rng.randint(*(d.mul_range if op == "*" else d.add_range)) for op in ops]
        problem = Problem(operands=tuple(operands), ops=ops)
        if not _in_bound(problem, bound):
            continue
        if split is None or is_heldout(problem) == (split == "heldout"):
            return problem


def trace_steps(
    problem: Problem, rng: random.Random, *, flaw_rate: float = 0.0, error_rate: float = 0.0
) -> tuple[list[str], list[int], int]:
    """Written steps (``"12+7=19"``), their exact labels (1 / -1) and the written final answer.

    One draw decides whether this whole trace carries the sign-dropping flaw; then each step
    may get a random wrong value with probability ``error_rate``. The chain always continues
    from the value actually written.
    """
    if not (0.0 <= flaw_rate <= 1.0 and 0.0 <= error_rate <= 1.0):
        raise ValueError(
            f"rates must be in [0, 1], got flaw_rate={flaw_rate} error_rate={error_rate}")
    flawed = rng.random() < flaw_rate
    true_values = problem.values
    value = problem.operands[0]
    steps: list[str] = []
    labels: list[int] = []
    for op, b, true_value in zip(problem.ops, problem.operands[1:], true_values, strict=True):
        result = _apply(value, op, b)
        if flawed:
            result = abs(result)
        if error_rate > 0 and rng.random() < error_rate:
            result += rng.choice((-5, -4, -3, -2, -1, 1, 2, 3, 4, 5))
        steps.append(f"{value}{op}{b}={result}")
        labels.append(1 if result == true_value else -1)
        value = result
    return steps, labels, value


def format_trace(steps: list[str], answer: int | str) -> str:
    """``<think>s1; s2</think><answer>a</answer>``."""
    return f"<think>{'; '.join(steps)}</think><answer>{answer}</answer>"


def render_trace(
    problem: Problem, rng: random.Random, *, flaw_rate: float = 0.0, error_rate: float = 0.0
) -> tuple[str, list[int]]:
    """The completion text of one (possibly imperfect) trace and its per-step labels."""
    steps, labels, final = trace_steps(problem, rng, flaw_rate=flaw_rate, error_rate=error_rate)
    return format_trace(steps, final), labels


def stream_key(key: str, difficulty: str) -> str:
    """A random stream's name: ``key`` itself for ``"easy"`` (so the default draws are what
    they always were), ``"<difficulty>:<key>"`` for any other difficulty."""
    difficulty_of(difficulty)
    return key if difficulty == "easy" else f"{difficulty}:{key}"


def _problems(n: int, seed: int, split: str, distinct: bool, stream: str,
              difficulty: str = "easy") -> list[Problem]:
    """``n`` problems from ``split``, deterministic in ``seed``; ``distinct`` drops repeats.

    Each generator has its own ``stream``, so SFT, RL and step rows with the same seed are
    independent draws (held-out rows only depend on ``seed`` and ``difficulty``).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    key = f"{split}:{seed}" if split == "heldout" else f"{stream}:{split}:{seed}"
    rng = random.Random(stream_key(key, difficulty))
    out: list[Problem] = []
    seen: set[Problem] = set()
    while len(out) < n:
        problem = sample_problem(rng, split=split, difficulty=difficulty)
        if distinct and problem in seen:
            continue
        seen.add(problem)
        out.append(problem)
    return out


def sft_rows(
    n: int, seed: int = 0, *, flaw_rate: float = 0.0, error_rate: float = 0.0,
    difficulty: str = "easy",
) -> list[dict]:
    """SFT rows ``{"prompt", "completion"}`` from the train split."""
    rng = random.Random(stream_key(f"trace:{seed}", difficulty))
    rows = []
    for problem in _problems(n, seed, "train", distinct=False, stream="sft",
                             difficulty=difficulty):
        text, _ = render_trace(problem, rng, flaw_rate=flaw_rate, error_rate=error_rate)
        rows.append({"prompt": problem.text, "completion": text})
    return rows


def prompt_rows(n: int, seed: int = 0, split: str = "train", *,
                difficulty: str = "easy") -> list[dict]:
    """RL prompt rows ``{"prompt", "answer"}``; held-out rows are distinct problems."""
    problems = _problems(n, seed, split, distinct=split == "heldout", stream="prompts",
                         difficulty=difficulty)
    return [{"prompt": p.text, "answer": str(p.answer)} for p in problems]


def heldout_rows(n: int, seed: int = 0, *, difficulty: str = "easy") -> list[dict]:
    """``n`` distinct held-out prompt rows, the same for the same ``(n, seed, difficulty)``."""
    return prompt_rows(n, seed, split="heldout", difficulty=difficulty)


def step_rows(
    n: int, seed: int = 0, *, flaw_rate: float = 0.0, error_rate: float = 0.2,
    split: str = "train", difficulty: str = "easy",
) -> list[dict]:
    """Process-label rows ``{"prompt", "steps", "labels"}`` with exact labels (1 / -1)."""
    rng = random.Random(stream_key(f"steps:{seed}", difficulty))
    rows = []
    for problem in _problems(n, seed, split, distinct=False, stream="steps",
                             difficulty=difficulty):
        steps, labels, _ = trace_steps(problem, rng, flaw_rate=flaw_rate, error_rate=error_rate)
        rows.append({"prompt": problem.text, "steps": steps, "labels": labels})
    return rows


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write one JSON object per line (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def space_size(
    *, min_ops: int | None = None, max_ops: int | None = None, bound: int | None = None,
    difficulty: str | Difficulty = "easy",
) -> int:
    """Exact number of distinct problems the sampler can emit (both splits), by dynamic
    programming over (true value, sign-dropped value) pairs; arguments as
    :func:`sample_problem`'s."""
    d = difficulty_of(difficulty)
    min_ops = d.min_ops if min_ops is None else min_ops
    max_ops = d.max_ops if max_ops is None else max_ops
    bound = d.bound if bound is None else bound
    states: Counter[tuple[int, int]] = Counter(
        {(a, a): 1 for a in range(d.add_range[0], d.add_range[1] + 1)}
    )
    total = 0
    for n_ops in range(1, max_ops + 1):
        nxt: Counter[tuple[int, int]] = Counter()
        for (true_v, flawed_v), count in states.items():
            for op in OPS:
                lo, hi = d.mul_range if op == "*" else d.add_range
                for b in range(lo, hi + 1):
                    t, f = _apply(true_v, op, b), abs(_apply(flawed_v, op, b))
                    if abs(t) <= bound and f <= bound:
                        nxt[(t, f)] += count
        states = nxt
        if n_ops >= min_ops:
            total += sum(states.values())
    return total
