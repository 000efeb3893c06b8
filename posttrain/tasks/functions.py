"""Function synthesis: write ``f(x)`` from three input/output examples (the offline code task).

A problem is a linear function with an integer slope, shown by its values at three consecutive
inputs; the model writes a one-line Python program, and held-out asserts at inputs the prompt
does not show decide whether it is right::

    prompt      f(4)=-3,f(5)=-1,f(6)=1
    completion  def f(x): return -3+(-1--3)*(x-4)
    tests       ["assert f(-2) == -15", "assert f(13) == 15", "assert f(7) == 3"]

The reference program is in point-slope form, ``y0+(y1-y0)*(x-x0)``, built from the first two
examples: the program computes the slope, so the model only has to put the right numbers in the
right places (``-1--3`` is valid Python, ``-1 - (-3)``). Deliberate: a ~0.5M-parameter character
model trained for minutes learns this copying, but not the in-head subtraction of writing the
slope as a number (measured: the slope digit right on 10% of held-out problems after 800 SFT
steps, chance is 6%), let alone the multiplication of the slope-intercept form ``a*x+b``.

Sampling: slope ``a`` uniform in ``-9..9`` without 0, first input ``x0`` uniform in ``0..9``,
first value ``y0`` uniform in ``-30..30``; the space holds 18 * 10 * 61 = 10,980 problems
(:func:`space_size`). The tests are ``num_tests`` distinct inputs drawn from ``-9..20`` minus the
three shown, seeded by the prompt text, so a problem always has the same tests.

Held-out split: a problem is held out when a hash of its prompt falls in the first 10% of the
hash range (about 1,100 problems). Training generators never emit a held-out problem.

Systematic flaw for RL headroom (``flaw_rate``): on this fraction of SFT traces the program
drops the parentheses around ``x-x0``, ``return -3+(-1--3)*x-4``, the classic precedence bug: it
computes ``y0 + a*x - x0``, which is right only when ``x0 == 0`` or ``a == 1``. The choice between
``(`` and ``x`` after ``*`` is the same on every problem, so a model imitating such data writes
the bug under greedy decoding whenever ``flaw_rate > 0.5``, while sampling still writes the
parentheses ``1 - flaw_rate`` of the time: a verifier-driven RL step can fix what imitation
taught wrong.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from posttrain.tasks.arithmetic import write_jsonl

SLOPES: tuple[int, ...] = tuple(a for a in range(-9, 10) if a != 0)
X0_RANGE: tuple[int, int] = (0, 9)
Y0_RANGE: tuple[int, int] = (-30, 30)
TEST_INPUTS: tuple[int, ...] = tuple(range(-9, 21))
NUM_SHOWN = 3
NUM_TESTS = 3
HELDOUT_FRACTION: float = 0.10
_HASH_BUCKETS = 10_000
_PROMPT_RE = re.compile(r"^f\((\d+)\)=(-?\d+),f\((\d+)\)=(-?\d+),f\((\d+)\)=(-?\d+)$")

__all__ = ["FunctionProblem", "code_rows", "heldout_rows", "is_heldout", "parse_prompt",
           "program", "sample_problem", "sft_rows", "space_size", "write_jsonl"]


@dataclass(frozen=True)
class FunctionProblem:
    """``f(x) = y0 + slope * (x - x0)``, shown at ``x0, x0+1, x0+2``."""

    slope: int
    x0: int
    y0: int

    def __call__(self, x: int) -> int:
        return self.y0 + self.slope * (x - self.x0)

    @property
    def shown(self) -> tuple[int, ...]:
        """The inputs the prompt shows."""
        return tuple(range(self.x0, self.x0 + NUM_SHOWN))

    @property
    def prompt(self) -> str:
        """Canonical prompt, e.g. ``f(4)=-3,f(5)=-1,f(6)=1``."""
        return ",".join(f"f({x})={self(x)}" for x in self.shown)

    def test_inputs(self, num_tests: int = NUM_TESTS) -> list[int]:
        """``num_tests`` distinct inputs not shown in the prompt, fixed by the prompt text."""
        pool = [x for x in TEST_INPUTS if x not in self.shown]
        if not 1 <= num_tests <= len(pool):
            raise ValueError(f"num_tests must be in 1..{len(pool)}, got {num_tests}")
        return random.Random(f"tests:{self.prompt}").sample(pool, num_tests)

    def tests(self, num_tests: int = NUM_TESTS) -> list[str]:
        """One assert per held-out input, e.g. ``assert f(13) == 15``."""
        return [f"assert f({x}) == {self(x)}" for x in self.test_inputs(num_tests)]


def program(problem: FunctionProblem, *, flawed: bool = False) -> str:
    """The one-line reference program; ``flawed`` drops the parentheses (precedence bug)."""
    y0, y1 = problem.y0, problem(problem.x0 + 1)
    arg = f"x-{problem.x0}" if flawed else f"(x-{problem.x0})"
    return f"def f(x): return {y0}+({y1}-{y0})*{arg}"


def parse_prompt(text: str) -> FunctionProblem:
    """Parse a canonical prompt back into its problem (checks the examples are consistent)."""
    match = _PROMPT_RE.match(text)
    if match is None:
        raise ValueError(f"not a function prompt: {text!r} (expected e.g. 'f(1)=5,f(2)=7,f(3)=9')")
    xs, ys = [int(v) for v in match.groups()[0::2]], [int(v) for v in match.groups()[1::2]]
    problem = FunctionProblem(slope=ys[1] - ys[0], x0=xs[0], y0=ys[0])
    if problem.prompt != text:
        raise ValueError(f"function prompt {text!r} is not three consecutive values of a line")
    return problem


def is_heldout(problem: FunctionProblem | str) -> bool:
    """True when the problem belongs to the fixed held-out split (hash of its prompt)."""
    text = problem if isinstance(problem, str) else problem.prompt
    digest = hashlib.blake2b(f"functions:{text}".encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _HASH_BUCKETS < HELDOUT_FRACTION * _HASH_BUCKETS


def sample_problem(rng: random.Random, split: str | None = "train") -> FunctionProblem:
    """Draw one problem. ``split`` is ``"train"``, ``"heldout"`` or ``None`` (either)."""
    if split not in ("train", "heldout", None):
        raise ValueError(f"unknown split {split!r}; valid: ['train', 'heldout', None]")
    while True:
        problem = FunctionProblem(slope=rng.choice(SLOPES), x0=rng.randint(*X0_RANGE),
                                  y0=rng.randint(*Y0_RANGE))
        if split is None or is_heldout(problem) == (split == "heldout"):
            return problem


def all_problems() -> list[FunctionProblem]:
    """Every problem of the space, in a fixed order."""
    return [FunctionProblem(a, x0, y0) for a in SLOPES for x0 in range(X0_RANGE[0], X0_RANGE[1] + 1)
            for y0 in range(Y0_RANGE[0], Y0_RANGE[1] + 1)]


def space_size() -> int:
    """Number of distinct problems (both splits): slopes x first inputs x first values."""
    return len(SLOPES) * (X0_RANGE[1] - X0_RANGE[0] + 1) * (Y0_RANGE[1] - Y0_RANGE[0] + 1)


def sft_rows(n: int, seed: int = 0, *, flaw_rate: float = 0.0) -> list[dict]:
    """SFT rows ``{"prompt", "completion"}`` from the train split (repeats allowed)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0.0 <= flaw_rate <= 1.0:
        raise ValueError(f"flaw_rate must be in [0, 1], got {flaw_rate}")
    rng = random.Random(f"functions-sft:{seed}")
    rows = []
    for _ in range(n):
        problem = sample_problem(rng, "train")
        rows.append({"prompt": problem.prompt,
                     "completion": program(problem, flawed=rng.random() < flaw_rate)})
    return rows


def code_rows(n: int, seed: int = 0, split: str = "train", *,
              num_tests: int = NUM_TESTS) -> list[dict]:
    """Code-task rows ``{"prompt", "tests", "solution"}``; held-out rows are distinct.

    ``tests`` are asserts at inputs the prompt does not show; ``solution`` (the reference
    program) is for reading only - no reward uses it.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"functions-{split}:{seed}")
    distinct = split == "heldout"
    if distinct and n > (available := sum(is_heldout(p) for p in all_problems())):
        raise ValueError(f"asked for {n} distinct held-out problems; the split has {available}")
    rows, seen = [], set()
    while len(rows) < n:
        problem = sample_problem(rng, split)
        if distinct and problem in seen:
            continue
        seen.add(problem)
        rows.append({"prompt": problem.prompt, "tests": problem.tests(num_tests),
                     "solution": program(problem)})
    return rows


def heldout_rows(n: int, seed: int = 0, *, num_tests: int = NUM_TESTS) -> list[dict]:
    """``n`` distinct held-out code rows, the same for the same ``(n, seed)``."""
    return code_rows(n, seed, "heldout", num_tests=num_tests)

