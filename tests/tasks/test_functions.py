"""Function-synthesis task: golden problems, programs, tests, split, flaw and row formats."""

import random

import pytest

from posttrain.data import load_rows
from posttrain.rewards import code_reward
from posttrain.tasks import functions as F
from posttrain.tasks.arithmetic import write_jsonl
from posttrain.tasks.tokenizer import build_char_tokenizer


def _run(program: str, x: int) -> int:
    """Evaluate a trusted one-line reference program in-process (our own generator's output)."""
    scope: dict = {}
    exec(program, scope)  # noqa: S102 - generator output, not model output
    return scope["f"](x)


def test_golden_problem_program_and_flaw():
    p = F.FunctionProblem(slope=2, x0=1, y0=5)
    # f(x) = 5 + 2*(x-1): f(1)=5, f(2)=7, f(3)=9
    assert p.prompt == "f(1)=5,f(2)=7,f(3)=9"
    assert F.program(p) == "def f(x): return 5+(7-5)*(x-1)"
    assert F.program(p, flawed=True) == "def f(x): return 5+(7-5)*x-1"
    # f(10): right 5+2*9 = 23; flawed 5+2*10-1 = 24
    assert _run(F.program(p), 10) == 23 == p(10)
    assert _run(F.program(p, flawed=True), 10) == 24
    q = F.FunctionProblem(slope=-3, x0=4, y0=-7)
    # -7-3*(x-4): f(4)=-7, f(5)=-10, f(6)=-13
    assert q.prompt == "f(4)=-7,f(5)=-10,f(6)=-13"
    # the slope is computed by the program: -10-(-7) = -3
    assert F.program(q) == "def f(x): return -7+(-10--7)*(x-4)"
    assert _run(F.program(q), 0) == -7 + 12 == q(0)


def test_every_reference_program_is_right_and_short():
    tok = build_char_tokenizer()
    for p in F.all_problems()[::37]:
        text = F.program(p)
        assert len(text) < 40
        assert tok.unk_token_id not in tok(text + p.prompt, add_special_tokens=False)["input_ids"]
        for x in (*p.shown, *p.test_inputs()):
            assert _run(text, x) == p(x)


def test_flaw_is_wrong_exactly_when_x0_nonzero_and_slope_not_one():
    for p in F.all_problems()[::11]:
        flawed = F.program(p, flawed=True)
        # y0 + a*x - x0 equals y0 + a*(x - x0) for every x iff a*x0 == x0
        right_everywhere = all(_run(flawed, x) == p(x) for x in F.TEST_INPUTS)
        assert right_everywhere == (p.x0 == 0 or p.slope == 1)


def test_tests_use_unshown_distinct_inputs_and_are_stable():
    rng = random.Random(0)
    for _ in range(300):
        p = F.sample_problem(rng, split=None)
        xs = p.test_inputs()
        assert len(set(xs)) == F.NUM_TESTS and not set(xs) & set(p.shown)
        assert xs == F.FunctionProblem(p.slope, p.x0, p.y0).test_inputs()
        assert p.tests() == [f"assert f({x}) == {p(x)}" for x in xs]
    with pytest.raises(ValueError, match="num_tests"):
        F.FunctionProblem(1, 0, 0).test_inputs(0)


def test_reference_passes_and_flaw_fails_in_the_sandbox():
    p = F.FunctionProblem(slope=2, x0=3, y0=-4)
    assert code_reward(F.program(p), p.tests(), timeout_s=5.0) == 1.0
    assert code_reward(F.program(p, flawed=True), p.tests(), timeout_s=5.0) == 0.0


def test_space_size_matches_enumeration():
    # 18 slopes (-9..9 without 0) x 10 first inputs (0..9) x 61 first values (-30..30)
    assert F.space_size() == 18 * 10 * 61 == len(set(F.all_problems())) == 10_980
    prompts = {p.prompt for p in F.all_problems()}
    assert len(prompts) == 10_980  # the prompt identifies the problem


def test_parse_prompt_roundtrip_and_rejects_bad_text():
    rng = random.Random(1)
    for _ in range(200):
        p = F.sample_problem(rng, split=None)
        assert F.parse_prompt(p.prompt) == p
    for bad in ["", "f(1)=5", "f(1)=5,f(2)=7", "f(1)=5;f(2)=7;f(3)=9", "f(-1)=5,f(0)=7,f(1)=9"]:
        with pytest.raises(ValueError, match="not a function prompt"):
            F.parse_prompt(bad)
    with pytest.raises(ValueError, match="consecutive values of a line"):
        F.parse_prompt("f(1)=5,f(2)=7,f(3)=10")  # slope 2 then 3: not a line
    with pytest.raises(ValueError, match="consecutive values of a line"):
        F.parse_prompt("f(1)=5,f(3)=7,f(5)=9")  # inputs not consecutive


def test_heldout_split_is_disjoint_and_about_ten_percent():
    heldout = [p for p in F.all_problems() if F.is_heldout(p)]
    assert 0.08 < len(heldout) / F.space_size() < 0.12
    rows = F.heldout_rows(500)
    assert len({r["prompt"] for r in rows}) == 500
    assert all(F.is_heldout(r["prompt"]) for r in rows)
    assert rows == F.heldout_rows(500)  # deterministic
    for row in F.code_rows(500, seed=3) + F.sft_rows(500, seed=3):
        assert not F.is_heldout(row["prompt"])
    with pytest.raises(ValueError, match="distinct held-out"):
        F.heldout_rows(len(heldout) + 1)


def test_sft_flaw_rate_is_respected():
    rows = F.sft_rows(4000, seed=0, flaw_rate=0.6)
    frac = sum("*x-" in r["completion"] for r in rows) / len(rows)
    assert 0.57 < frac < 0.63  # binomial sd = sqrt(.6*.4/4000) = 0.008
    assert not any("*x-" in r["completion"] for r in F.sft_rows(500, seed=0))
    for r in rows[:200]:
        p = F.parse_prompt(r["prompt"])
        assert r["completion"] in (F.program(p), F.program(p, flawed=True))
    with pytest.raises(ValueError, match="flaw_rate"):
        F.sft_rows(1, flaw_rate=1.5)


def test_rows_validate_against_the_data_schemas(tmp_path):
    sft = load_rows(write_jsonl(F.sft_rows(20), tmp_path / "sft.jsonl"), kind="sft")
    code = load_rows(write_jsonl(F.code_rows(20), tmp_path / "code.jsonl"), kind="code")
    # RL and evaluation load code rows with kind "prompts": tests pass through untouched
    prompts = load_rows(tmp_path / "code.jsonl", kind="prompts")
    assert len(sft) == len(code) == 20 and prompts == code
    assert set(code[0]) == {"prompt", "tests", "solution"}
    assert F.parse_prompt(code[0]["prompt"]).tests() == code[0]["tests"]
