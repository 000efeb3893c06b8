"""Judge holes of issue 56: where the judge does not reproduce plain Python, the test fails,
never passes. One test per class (the held-out programs are not given: each test is a class's
shape), in both sandbox modes (the `mode` fixture of test_sandbox_adversarial)."""

from __future__ import annotations

import random

import pytest

from posttrain.rewards import SandboxLimits, code_reward_detailed
from tests.rewards.test_sandbox_adversarial import mode

__all__ = ["mode"]

LIMITS = SandboxLimits(timeout_s=3.0)


def _score(program: str, tests: str | list, mode: str) -> tuple[float, object]:
    return code_reward_detailed(program, tests, 3.0, partial=True, mode=mode, limits=LIMITS)


# ---- 4. the import guard resolves the file it loads; a code object's file name is data -----
# A module the program wrote that rewrites the test's `f` (a wrong f(1) == 0 then passes).
_PATCH = ("import sys\nfr = sys._getframe()\n"
          "while fr is not None and fr.f_code.co_filename != '<test>':\n    fr = fr.f_back\n"
          "fr.f_globals['f'] = lambda x: 5\n")


@pytest.fixture
def where() -> str:
    return f"/tmp/judge56_{random.randrange(10**9)}"


def test_a_module_reached_through_dotdot_from_the_stdlib_never_runs(mode: str, where: str
                                                                    ) -> None:
    program = (f"import os\nos.makedirs({where!r})\n"
               f"open({where!r} + '/evil.py', 'w').write({_PATCH!r})\n"
               "def f(x):\n    return 0\n")
    test = ("import os, sys\nstdlib = os.path.dirname(os.__file__)\n"  # <stdlib>/../../../tmp/..
            f"sys.path.insert(0, stdlib + '/..' * stdlib.count('/') + {where!r})\n"
            "import evil\nassert f(1) == 5\n")
    score, result = _score(program, [test], mode)
    assert score == 0.0 and result.test_status == ["failed"], result.test_status


def test_a_pyc_claiming_a_stdlib_file_name_never_runs(mode: str, where: str) -> None:
    program = ("import os, marshal, importlib.util\n"
               f"os.makedirs({where!r})\n"
               f"code = compile({_PATCH!r}, os.path.dirname(os.__file__) + '/fractions.py', "
               "'exec')\n"
               f"open({where!r} + '/evil.pyc', 'wb').write(importlib.util.MAGIC_NUMBER + "
               "b'\\0' * 12 + marshal.dumps(code))\n"
               "def f(x):\n    return 0\n")
    test = f"import sys\nsys.path.insert(0, {where!r})\nimport evil\nassert f(1) == 5\n"
    score, result = _score(program, [test], mode)
    assert score == 0.0 and result.test_status == ["failed"], result.test_status


def test_the_standard_library_still_imports_during_a_test(mode: str) -> None:
    test = ("from fractions import Fraction\nimport statistics, decimal, heapq, string\n"
            "from collections import namedtuple\nfrom dataclasses import dataclass\n"
            "P = namedtuple('P', 'x y')\n"
            "@dataclass\nclass Q:\n    a: int\n"
            "assert f(1) == 5 and Fraction(1, 2) == 0.5 and statistics.mean([1, 3]) == 2\n"
            "assert P(1, 2).x == 1 and Q(3).a == 3\n")
    assert _score("def f(x):\n    return 5\n", [test], mode)[0] == 1.0
