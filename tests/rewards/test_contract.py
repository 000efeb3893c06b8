"""The reward contract (issue 24, items 1-3): entry keys, needed fields, TRL-style batched
functions, and a reward that fails on most samples stopping the run."""

from __future__ import annotations

import math

import pytest

from posttrain.rewards import RewardFunctionError, Rewards, RewardSpec, validate_specs
from posttrain.rewards.contract import BATCHED, PER_SAMPLE, ROWS, call_style


def trl_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trl_with_fields(completions, prompts=None, answer=None, **kwargs):
    # TRL passes every column as a list, one value per sample
    return [float(c == a) + 0.5 * (p == "q1") for c, p, a in
            zip(completions, prompts, answer, strict=True)]


def trl_needs_solution(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution, strict=True)]


def flagged(texts, **kwargs):
    return [1.0 for _ in texts]


flagged.batched = True


def rows_form(completions, rows, *, scale=1.0):
    return [scale] * len(completions)


rows_form.batched = True


def only_short(completions, **kwargs):
    return [1.0 if len(c) < 3 else None for c in completions]


def always_fails(completion, **kwargs):
    raise KeyError("no such thing")


def per_sample(completion, answer, *, bonus=0.0):
    return float(completion == answer) + bonus


def test_call_styles():
    assert call_style(per_sample) == PER_SAMPLE
    assert call_style(trl_length) == BATCHED and call_style(flagged) == BATCHED
    assert call_style(rows_form) == ROWS


def test_trl_batched_function_is_called_once_with_lists():
    calls = []

    def spy(completions, prompts, **kwargs):
        calls.append((list(completions), list(prompts), {k: list(v) for k, v in kwargs.items()}))
        return [1.0, 2.0]

    rows = [{"prompt": "q1", "answer": "7", "id": 1}, {"prompt": "q2", "answer": "8", "id": 2}]
    result = Rewards([RewardSpec("spy", fn=spy)]).score(["a", "bb"], rows)
    assert calls == [(["a", "bb"], ["q1", "q2"], {"answer": ["7", "8"], "id": [1, 2]})]
    assert result.scores == [1.0, 2.0]


def test_trl_batched_values_and_named_fields():
    rows = [{"prompt": "q1", "answer": "7"}, {"prompt": "q2", "answer": "8"}]
    scorer = Rewards([RewardSpec("len", 1.0, fn=trl_length),
                           RewardSpec("fields", 2.0, fn=trl_with_fields),
                           RewardSpec("flag", 1.0, fn=flagged)])
    result = scorer.score(["7", "xx"], rows)
    # len: 1, 2; fields: (1 + 0.5) for sample 0, (0 + 0) for sample 1 (x2); flag: 1 and 1
    assert result.per_function["len"] == [1.0, 2.0]
    assert result.per_function["fields"] == [1.5, 0.0]
    assert result.scores == [1.0 + 3.0 + 1.0, 2.0 + 0.0 + 1.0]
    assert result.metrics["reward/errors/len"] == 0.0


def test_none_means_not_applicable():
    # sample 0 ("ab"): only_short applies (1.0); sample 1 ("abcd"): no function applies, so it
    # scores 0 as in TRL (kept, not unscorable), counted in reward/unscored and recorded
    result = Rewards([RewardSpec("short", fn=only_short)]).score(
        ["ab", "abcd"], [{"prompt": "p"}, {"prompt": "p"}])
    assert result.scores == [1.0, 0.0]
    assert result.metrics["reward/unscorable"] == 0.0 and result.metrics["reward/unscored"] == 1.0
    assert [(e["function"], e["index"]) for e in result.errors] == [(None, 1)]
    assert math.isnan(result.per_function["short"][1])


def short_or_none(completion: str) -> float | None:  # the per-sample form of `only_short`
    return 1.0 if len(completion) < 3 else None


def test_none_sums_the_other_functions_as_trl_does():
    # per-sample and batched None alike: "does not score this sample", never an error;
    # sample 1: short=None, len=4 (weight 0.5) -> 2.0; sample 0: 1 + 0.5 * 2 = 2.0
    scorer = Rewards([RewardSpec("short", fn=short_or_none),
                           RewardSpec("short_b", fn=only_short),
                           RewardSpec("len", 0.5, fn=trl_length)])
    result = scorer.score(["ab", "abcd"], [{"prompt": "p"}, {"prompt": "p"}])
    assert result.scores == [1.0 + 1.0 + 1.0, 2.0]
    assert result.errors == [] and result.metrics["reward/errors/short"] == 0.0
    assert result.metrics["reward/short_mean"] == 1.0  # the mean of the samples it scored
    assert result.metrics["reward/unscored"] == 0.0


def nan_for_x(completion: str) -> float:
    return float("nan") if "x" in completion else 1.0


def nan_batched(completions, **kwargs):
    return [float("nan") if "x" in c else 1.0 for c in completions]


@pytest.mark.parametrize("fn", [nan_for_x, nan_batched])
def test_a_nan_reward_is_an_error_with_its_sample(fn):
    rows = [{"prompt": "p"}] * 4
    result = Rewards([RewardSpec("r", fn=fn)]).score(["a", "b", "c", "xyz"], rows)
    assert result.scores == [1.0, 1.0, 1.0, 0.0]  # scored 0 like any error, the group is kept
    assert result.metrics["reward/errors/r"] == 1.0
    (err,) = result.errors
    assert err["index"] == 3 and err["completion"] == "xyz" and "nan" in err["error"]
    with pytest.raises(RewardFunctionError):  # most of a batch NaN: the run stops (auto)
        Rewards([RewardSpec("r", fn=fn)]).score(["x", "xx", "xxx", "a"], rows)


def test_unknown_entry_key_is_refused_with_did_you_mean():
    spec = RewardSpec.from_dict({"name": "math", "wieght": 2})
    with pytest.raises(ValueError) as err:
        validate_specs([spec])
    message = str(err.value)
    assert "unknown key 'wieght'" in message and "Did you mean 'weight'?" in message
    assert "\n" not in message
    # a key the function takes is fine, and **kwargs takes anything
    validate_specs([RewardSpec.from_dict({"name": "math", "timeout_s": 2})])
    validate_specs([RewardSpec("len", kwargs={"anything": 1}, fn=trl_length)])
    with pytest.raises(ValueError, match="unknown key 'bonsu'.*'bonus'"):
        validate_specs([RewardSpec("p", kwargs={"bonsu": 1}, fn=per_sample)])


def test_needed_fields():
    scorer = Rewards(["math", "format", RewardSpec("sol", fn=trl_needs_solution),
                           RewardSpec("p", kwargs={"answer": "1"}, fn=per_sample),
                           RewardSpec("rows", fn=rows_form)])
    # math needs `answer`; per_sample gets it from its entry; format and rows_form need nothing
    assert scorer.needed_fields() == {"answer": ["math"], "solution": ["sol"]}


def trl_curriculum(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step > 10)] * len(completions)


def trl_curriculum_default(completions, trainer_state=None, **kwargs):
    return [1.0] * len(completions)


def test_trainer_state_in_a_signature_is_named_not_a_missing_column():
    """Issue 57: TRL passes `trainer_state`; posttrain does not, so a reward that requires it
    is refused by name before any model loads, not reported as a missing dataset column."""
    with pytest.raises(ValueError) as err:
        validate_specs([RewardSpec("cur", fn=trl_curriculum)])
    message = str(err.value)
    assert "'trainer_state' is TRL's TrainerState" in message and "trainer_state=None" in message
    assert "\n" not in message and "column" not in message
    validate_specs([RewardSpec("cur", fn=trl_curriculum_default)])  # a default: never needed
    assert Rewards([RewardSpec("cur", fn=trl_curriculum_default)]).needed_fields() == {}


def test_a_reward_failing_on_most_samples_stops_the_run():
    scorer = Rewards([RewardSpec("broken", fn=always_fails), "format"])
    with pytest.raises(RewardFunctionError) as err:
        scorer.score(["first\nsample", "second"], [{}, {}])
    message = str(err.value)
    assert "'broken' failed on sample 0" in message and "KeyError('no such thing')" in message
    assert "'first\\nsample'" in message and "reward_on_error: zero" in message
    assert "\n" not in message and err.value.completion == "first\nsample"
    # zero keeps the old behaviour: scored 0, counted
    zero = Rewards([RewardSpec("broken", fn=always_fails)], on_error="zero")
    result = zero.score(["a", "b"], [{}, {}])
    assert result.scores == [0.0, 0.0] and result.metrics["reward/errors/broken"] == 2.0


def test_a_few_failures_are_counted_not_raised():
    def sometimes(completion):
        if completion == "bad":
            raise ValueError("bad sample")
        return 1.0

    result = Rewards([RewardSpec("some", fn=sometimes)]).score(
        ["bad", "ok", "ok"], [{}, {}, {}])
    assert result.scores == [0.0, 1.0, 1.0] and result.metrics["reward/errors/some"] == 1.0


def test_trl_function_called_per_sample_would_have_failed_everywhere():
    """The issue's silent zero: a wrong return type is an error, and here a stop."""
    def wrong(completions, **kwargs):
        return 1.0  # not a list

    with pytest.raises(RewardFunctionError, match="must return a list"):
        Rewards([RewardSpec("wrong", fn=wrong)]).score(["a", "b"], [{}, {}])


def test_raise_keeps_the_sample_in_the_message():
    scorer = Rewards([RewardSpec("broken", fn=always_fails)], on_error="raise")
    with pytest.raises(RewardFunctionError, match=r"sample 0: KeyError.*completion: 'boom'"):
        scorer.score(["boom"], [{}])
