"""Registry and scorer: built-ins, module:function targets, weights, errors, unscorable samples."""

from __future__ import annotations

import math
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.rewards import (
    BUILTIN_REWARDS,
    RewardFunctionError,
    Rewards,
    RewardSpec,
    format_reward,
    math_reward,
    resolve_reward,
    validate_specs,
)

USER_MODULE = '''
def length_reward(completion, target_len):
    return 1.0 if len(completion) == target_len else 0.0

def exploding_reward(completion):
    if "boom" in completion:
        raise RuntimeError("exploded")
    return 0.5

def everything_reward(completion, **fields):
    return float(len(fields))

not_callable = 3
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)


def test_builtins_resolve() -> None:
    assert resolve_reward("math") is math_reward
    assert resolve_reward("format") is format_reward
    assert set(BUILTIN_REWARDS) == {"math", "format", "code", "reward_model",
                                    "process_reward_model", "environment", "remote", "judge"}


def test_unknown_builtin_lists_valid_names() -> None:
    with pytest.raises(ValueError,
                       match=r"unknown reward 'maths'.*'code', 'environment', 'format', "
                             r"'judge', 'math'"):
        resolve_reward("maths")


@pytest.mark.parametrize(
    ("name", "message"),
    [("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
     ("math:", "expected 'package.module:function'"),
     ("a b:c", "expected 'package.module:function'"),
     ("posttrain.rewards.format:nope", "has no callable 'nope'")],
)
def test_bad_targets_name_the_spec(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        validate_specs([RewardSpec(name)])
    assert repr(name) in str(info.value)


def test_not_callable_target(user_module: str) -> None:
    with pytest.raises(ValueError, match="has no callable 'not_callable'"):
        validate_specs([f"{user_module}:not_callable"])


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "1", True])
def test_bad_weight(weight: object) -> None:
    with pytest.raises(ValueError, match="weight must be a finite number"):
        validate_specs([RewardSpec("math", weight=weight)])  # type: ignore[arg-type]


def test_duplicate_and_empty_specs() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        validate_specs(["math", "math"])
    with pytest.raises(ValueError, match="at least one"):
        validate_specs([])


def test_weighted_sum_and_metrics() -> None:
    scorer = Rewards([RewardSpec("math", 1.0), RewardSpec("format", 2.0)])
    completions = ["<think>r</think><answer>3</answer>", "<answer>4</answer>", "\\boxed{3}"]
    rows = [{"answer": "3", "prompt": "p"}] * 3
    result = scorer.score(completions, rows)
    # sample 0: 1.0*1 + 2.0*0.1 = 1.2; sample 1: 0 + 0 = 0; sample 2: 1 + 0 = 1
    assert result.scores == pytest.approx([1.2, 0.0, 1.0])
    assert result.per_function == {"math": [1.0, 0.0, 1.0], "format": [0.1, 0.0, 0.0]}
    assert result.metrics["reward/math_mean"] == pytest.approx(2 / 3)
    assert result.metrics["reward/format_mean"] == pytest.approx(0.1 / 3)
    assert result.metrics["reward/mean"] == pytest.approx((1.2 + 0 + 1) / 3)
    assert result.metrics["reward/errors/math"] == 0.0
    assert result.metrics["reward/unscorable"] == 0.0
    assert "code/passed" not in result.metrics  # no code function: no code counters
    assert result.errors == []


def test_user_function_gets_fields_by_name(user_module: str) -> None:
    scorer = Rewards([f"{user_module}:length_reward", f"{user_module}:everything_reward"])
    rows = [{"target_len": 3, "answer": "x"}, {"target_len": 5, "answer": "y"}]
    result = scorer.score(["abc", "abc"], rows)
    assert result.per_function[f"{user_module}:length_reward"] == [1.0, 0.0]
    assert result.per_function[f"{user_module}:everything_reward"] == [2.0, 2.0]  # **fields
    assert f"reward/{user_module}.length_reward_mean" in result.metrics


def test_spec_kwargs_are_passed() -> None:
    scorer = Rewards([RewardSpec("math", kwargs={"timeout_s": 3.0})])
    assert scorer.score(["<answer>2</answer>"], [{"answer": "2"}]).scores == [1.0]


def test_missing_field_is_a_clear_error() -> None:
    scorer = Rewards(["math"])
    with pytest.raises(ValueError, match=r"'math': sample 1 has no field\(s\) \['answer'\]"):
        scorer.score(["a", "b"], [{"answer": "1"}, {"tests": []}])


def test_errors_are_counted_and_recorded(user_module: str) -> None:
    name = f"{user_module}:exploding_reward"
    scorer = Rewards([name, "format"], on_error="zero")
    result = scorer.score(["fine", "boom here", "boom again"], [{}, {}, {}])
    assert result.per_function[name] == [0.5, 0.0, 0.0]
    assert result.scores == [0.5, 0.0, 0.0]
    assert result.metrics[f"reward/errors/{user_module}.exploding_reward"] == 2.0
    assert [(e["function"], e["index"]) for e in result.errors] == [(name, 1), (name, 2)]
    assert "RuntimeError('exploded')" in result.errors[0]["error"]
    assert result.errors[0]["completion"] == "boom here"


def test_on_error_raise_names_function_and_sample(user_module: str) -> None:
    scorer = Rewards([f"{user_module}:exploding_reward"], on_error="raise")
    with pytest.raises(RewardFunctionError, match=r"exploding_reward' failed on sample 1") as info:
        scorer.score(["fine", "boom"], [{}, {}])
    assert info.value.index == 1
    assert isinstance(info.value.__cause__, RuntimeError)


def test_bad_on_error() -> None:
    with pytest.raises(ValueError, match=r"unknown on_error 'ignore'; valid values"):
        Rewards(["math"], on_error="ignore")


def test_unscorable_samples_are_nan_and_counted() -> None:
    scorer = Rewards(["math", "format"])
    rows = [{"answer": "3"}, {"answer": "}{"}, {"answer": ""}]
    result = scorer.score(["<answer>3</answer>"] * 3, rows)
    assert result.scores[0] == 1.0
    assert math.isnan(result.scores[1]) and math.isnan(result.scores[2])
    assert result.metrics["reward/unscorable"] == 2.0
    assert result.metrics["reward/errors/math"] == 0.0  # unscorable is not an error
    assert result.metrics["reward/mean"] == 1.0  # the mean skips unscorable samples


def test_code_counters_in_metrics() -> None:
    scorer = Rewards(["code"], max_workers=2)
    completions = ["def f(x):\n    return x + 1", "def f(x):\n    return x", "def f(:"]
    rows = [{"tests": ["assert f(1) == 2"]}] * 3
    result = scorer.score(completions, rows)
    assert result.scores == [1.0, 0.0, 0.0]
    assert result.metrics["code/passed"] == 1.0
    assert result.metrics["code/failed"] == 2.0
    assert result.metrics["code/timeout"] == 0.0
    assert result.metrics["code/in_process_verdicts"] == 0.0  # `f(1) == 2` is judged outside
    judged = scorer.score(completions[:1], [{"tests": ["assert f(1) > 1", "assert f(2) == 3"]}])
    assert judged.metrics["code/in_process_verdicts"] == 0.0  # both judged outside (a judge)
    # a callback cannot cross into the judge: that test is judged in the program's process
    program = "def f(x):\n    return x + 1\ndef apply(g, x):\n    return g(x)"
    mixed = scorer.score([program], [{"tests": ["assert apply(lambda v: v + 1, 1) == 2",
                                                "assert f(2) == 3"]}])
    assert mixed.metrics["code/in_process_verdicts"] == 1.0
