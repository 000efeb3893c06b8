import json
import random
import re

import pytest

from posttrain.tasks import arithmetic as A


def test_left_to_right_golden():
    p = A.parse_problem("12+7*3-5")
    # left to right: 12+7=19; 19*3=57; 57-5=52 (with precedence it would be 28)
    assert p.values == (19, 57, 52)
    assert p.answer == 52
    text, labels = A.render_trace(p, random.Random(0))
    assert text == "<think>12+7=19; 19*3=57; 57-5=52</think><answer>52</answer>"
    assert labels == [1, 1, 1]


def test_parse_roundtrip_and_rejects_garbage():
    rng = random.Random(3)
    for _ in range(200):
        p = A.sample_problem(rng, split=None)
        assert A.parse_problem(p.text) == p
    for bad in ["", "12", "12+", "1 + 2", "3/4", "-3+4"]:
        with pytest.raises(ValueError, match="arithmetic problem"):
            A.parse_problem(bad)


def test_sampled_problems_respect_ranges_and_bound():
    rng = random.Random(1)
    for _ in range(2000):
        p = A.sample_problem(rng, split=None)
        assert A.MIN_OPS <= len(p.ops) <= A.MAX_OPS
        assert all(abs(v) <= A.BOUND for v in p.values)
        assert all(abs(v) <= A.BOUND for v in A._chain(p, drop_sign=True))
        for op, b in zip(p.ops, p.operands[1:], strict=True):
            lo, hi = A.MUL_RANGE if op == "*" else A.ADD_RANGE
            assert lo <= b <= hi


def test_negative_fraction_between_40_and_60_percent():
    rng = random.Random(2)
    problems = [A.sample_problem(rng, split=None) for _ in range(5000)]
    frac = sum(p.has_negative for p in problems) / len(problems)
    assert 0.40 <= frac <= 0.60


def test_space_size_exact_small_case_and_full_size():
    # 1 op, bound 60: first number 0..20 (21 values); "+" and "-": 21*21 pairs each, all within
    # +-40; "*": 21 * 4 multipliers (2..5), all within 20*5 = 100 -> only a*b <= 60 counts.
    times = sum(1 for a in range(21) for b in range(2, 6) if a * b <= 60)
    assert A.space_size(min_ops=1, max_ops=1) == 2 * 21 * 21 + times
    assert A.space_size() >= 10**6


def test_space_size_matches_enumeration_for_two_ops():
    # brute force: enumerate all 2-op problems and apply the same bound rule
    count = 0
    ranges = {op: range(lo, hi + 1) for op, (lo, hi) in
              (("+", A.ADD_RANGE), ("-", A.ADD_RANGE), ("*", A.MUL_RANGE))}
    for a in range(21):
        for op1 in A.OPS:
            for b in ranges[op1]:
                for op2 in A.OPS:
                    for c in ranges[op2]:
                        p = A.Problem((a, b, c), (op1, op2))
                        count += A._in_bound(p, A.BOUND)
    assert A.space_size(min_ops=2, max_ops=2) == count


def test_heldout_split_is_disjoint_from_train():
    train = {r["prompt"] for r in A.sft_rows(3000, seed=0)}
    train |= {r["prompt"] for r in A.prompt_rows(3000, seed=1)}
    held = {r["prompt"] for r in A.heldout_rows(500)}
    assert not train & held
    assert all(A.is_heldout(t) for t in held)
    assert not any(A.is_heldout(t) for t in train)


def test_heldout_fraction_about_five_percent():
    rng = random.Random(5)
    problems = [A.sample_problem(rng, split=None) for _ in range(20000)]
    frac = sum(A.is_heldout(p) for p in problems) / len(problems)
    assert 0.04 <= frac <= 0.06


def test_heldout_rows_deterministic_distinct_and_correct():
    a, b = A.heldout_rows(300, seed=0), A.heldout_rows(300, seed=0)
    assert a == b
    assert A.heldout_rows(300, seed=1) != a
    assert len({r["prompt"] for r in a}) == 300
    for r in a:
        assert r["answer"] == str(A.parse_problem(r["prompt"]).answer)


def test_generators_deterministic_in_seed():
    assert A.sft_rows(50, seed=4, flaw_rate=0.6) == A.sft_rows(50, seed=4, flaw_rate=0.6)
    assert A.sft_rows(50, seed=4) != A.sft_rows(50, seed=5)
    assert A.step_rows(50, seed=4) == A.step_rows(50, seed=4)


def _steps_of(completion: str) -> list[str]:
    think = re.match(r"<think>(.*)</think><answer>(.*)</answer>$", completion)
    assert think is not None, completion
    return think.group(1).split("; ")


def test_clean_traces_are_exactly_correct():
    for row in A.sft_rows(300, seed=0):
        p = A.parse_problem(row["prompt"])
        steps = _steps_of(row["completion"])
        assert len(steps) == len(p.ops)
        left = p.operands[0]
        for step, op, b, v in zip(steps, p.ops, p.operands[1:], p.values, strict=True):
            assert step == f"{left}{op}{b}={v}"
            left = v
        assert row["completion"].endswith(f"<answer>{p.answer}</answer>")


def test_flaw_drops_every_minus_sign_consistently():
    # 3-5*4: true 3-5=-2; -2*4=-8. Flawed: 3-5=2; 2*4=8 and the answer follows the chain.
    p = A.parse_problem("3-5*4")
    text, labels = A.render_trace(p, random.Random(0), flaw_rate=1.0)
    assert text == "<think>3-5=2; 2*4=8</think><answer>8</answer>"
    assert labels == [-1, -1]


def test_flaw_rate_applies_per_trace_and_only_to_negative_problems():
    rng = random.Random(0)
    neg = [p for p in (A.sample_problem(rng) for _ in range(3000)) if p.has_negative][:1000]
    flawed = 0
    for p in neg:
        text, labels = A.render_trace(p, rng, flaw_rate=0.6)
        is_flawed = -1 in labels and "=-" not in text
        correct = all(lbl == 1 for lbl in labels)
        assert is_flawed != correct  # either fully correct or the whole trace is sign-dropped
        flawed += is_flawed
    assert 0.55 <= flawed / len(neg) <= 0.65
    clean = next(p for p in (A.sample_problem(rng) for _ in range(100)) if not p.has_negative)
    text, labels = A.render_trace(clean, rng, flaw_rate=1.0)
    assert labels == [1] * len(clean.ops)


def test_flawed_final_answer_differs_from_true_answer():
    rng = random.Random(9)
    for _ in range(500):
        p = A.sample_problem(rng)
        if not p.has_negative:
            continue
        text, labels = A.render_trace(p, rng, flaw_rate=1.0)
        answer = int(text.split("<answer>")[1].split("</answer>")[0])
        assert answer != p.answer
        assert answer == A._chain(p, drop_sign=True)[-1]
        assert labels[-1] == -1


def test_random_errors_labels_match_prefix_values():
    rows = A.step_rows(400, seed=0, error_rate=0.3)
    n_wrong = 0
    for row in rows:
        p = A.parse_problem(row["prompt"])
        assert len(row["steps"]) == len(row["labels"]) == len(p.ops)
        left = p.operands[0]
        for step, label, op, b, v in zip(row["steps"], row["labels"], p.ops, p.operands[1:],
                                         p.values, strict=True):
            lhs, rhs = step.split("=", 1)
            assert lhs == f"{left}{op}{b}"  # the chain continues from the written value
            assert label == (1 if int(rhs) == v else -1)
            left = int(rhs)
            n_wrong += label == -1
    assert n_wrong > 0


def test_error_rate_zero_gives_all_positive_labels():
    assert all(all(lbl == 1 for lbl in r["labels"]) for r in A.step_rows(200, error_rate=0.0))


def test_bad_rates_and_split_rejected():
    with pytest.raises(ValueError, match="flaw_rate"):
        A.render_trace(A.parse_problem("1+2+3"), random.Random(0), flaw_rate=1.5)
    with pytest.raises(ValueError, match="valid"):
        A.prompt_rows(3, split="test")


def test_write_jsonl_formats(tmp_path):
    path = A.write_jsonl(A.prompt_rows(5), tmp_path / "sub" / "p.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and set(rows[0]) == {"prompt", "answer"}
    assert isinstance(rows[0]["answer"], str)
    assert set(A.sft_rows(1)[0]) == {"prompt", "completion"}
    assert set(A.step_rows(1)[0]) == {"prompt", "steps", "labels"}


def test_generators_use_independent_streams():
    sft = [r["prompt"] for r in A.sft_rows(50, seed=0)]
    prompts = [r["prompt"] for r in A.prompt_rows(50, seed=0)]
    steps = [r["prompt"] for r in A.step_rows(50, seed=0)]
    assert sft != prompts and sft != steps and prompts != steps


def test_default_draws_unchanged_by_the_difficulty_knob():
    """The easy (default) rows of every generator are the ones drawn before ``difficulty``
    existed: this digest was computed on the code before the knob was added."""
    import hashlib

    from posttrain.tasks.step_labels import problems

    rng = random.Random(7)
    blob = {"prompt": A.prompt_rows(200, 0), "held": A.heldout_rows(50, 3),
            "sft": A.sft_rows(50, 1, flaw_rate=0.6, error_rate=0.2), "steps": A.step_rows(50, 2),
            "sample": [A.sample_problem(rng, split=None).text for _ in range(100)],
            "labels": [p.text for p in problems(30, 0, "train") + problems(30, 1, "heldout")],
            "space": A.space_size(min_ops=2, max_ops=3)}
    digest = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()
    assert digest == "bccf45bf49530c5cd8adfdb9ba358cab47a56d7f62ec937a43914c34052aaa9a"
    assert A.prompt_rows(5, 0, difficulty="easy") == A.prompt_rows(5, 0)


def _left_to_right(text: str) -> list[int]:
    """Every intermediate value, computed here without the module's own chain code."""
    tokens = re.findall(r"\d+|[+\-*]", text)
    value, out = int(tokens[0]), []
    for op, b in zip(tokens[1::2], tokens[2::2], strict=True):
        value = {"+": value + int(b), "-": value - int(b), "*": value * int(b)}[op]
        out.append(value)
    return out


def test_hard_split_has_more_steps_and_larger_numbers():
    rng_e, rng_h = random.Random(11), random.Random(11)
    easy = [A.sample_problem(rng_e, split=None) for _ in range(3000)]
    hard = [A.sample_problem(rng_h, split=None, difficulty="hard") for _ in range(3000)]
    assert {len(p.ops) for p in hard} == {4}
    assert sum(len(p.ops) for p in hard) / 3000 > sum(len(p.ops) for p in easy) / 3000 + 0.8
    assert max(abs(v) for p in easy for v in p.values) <= A.BOUND
    assert A.BOUND < max(abs(v) for p in hard for v in p.values) <= 99
    assert sum(max(abs(v) for v in p.values) > A.BOUND for p in hard) > 300  # > 10%
    multipliers = {b for p in hard for op, b in zip(p.ops, p.operands[1:], strict=True)
                   if op == "*"}
    assert multipliers == set(range(2, 10))
    for p in hard:
        assert list(p.values) == _left_to_right(p.text)
        assert all(abs(v) <= 99 for v in A._chain(p, drop_sign=True))
    rows = A.heldout_rows(200, 0, difficulty="hard")
    assert all(r["answer"] == str(_left_to_right(r["prompt"])[-1]) for r in rows)
    assert all(A.is_heldout(r["prompt"]) for r in rows) and len({r["prompt"] for r in rows}) == 200
    train = A.prompt_rows(500, 1, difficulty="hard")
    assert not any(A.is_heldout(r["prompt"]) for r in train)
    assert train != A.prompt_rows(500, 1)  # its own stream
    assert A.prompt_rows(50, 1, difficulty="hard") == train[:50]


def test_difficulty_overrides_space_size_and_errors():
    d = A.Difficulty(2, 2, (0, 5), (2, 9), 30)
    count = 0
    for a in range(6):
        for op1 in A.OPS:
            for b in (range(2, 10) if op1 == "*" else range(6)):
                for op2 in A.OPS:
                    for c in (range(2, 10) if op2 == "*" else range(6)):
                        count += A._in_bound(A.Problem((a, b, c), (op1, op2)), 30)
    assert A.space_size(difficulty=d) == count
    assert A.space_size(difficulty="hard") > A.space_size()
    rng = random.Random(0)
    assert len(A.sample_problem(rng, difficulty="hard", min_ops=2, max_ops=2).ops) == 2
    with pytest.raises(ValueError, match="difficulty"):
        A.prompt_rows(3, difficulty="medium")
