"""Issue 59: the rewards users write, in a run of the toy task: an async reward (the synchronous
trainer and the sampler process), a remote reward, a judge reward, and the tripwire."""

from __future__ import annotations

import json
import sys

import pytest

from tests.trainers.test_wrong_input_runs import _grpo


def _grpo_history(toy_world, out, reward: str, **kw) -> list[dict]:
    _grpo(toy_world, out, rewards=[reward], max_steps=2, group_size=4, **kw).train()
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _rewards(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["reward/mean"], r["reward/std"]) for r in rows]


def test_an_async_reward_trains_the_toy_task_as_its_sync_twin(toy_world, tmp_path) -> None:
    sync = _grpo_history(toy_world, tmp_path / "sync", "tests.trainers.toy_rewards:digits")
    both = _grpo_history(toy_world, tmp_path / "async", "tests.trainers.toy_rewards:digits_async")
    assert _rewards(both) == _rewards(sync) and len(sync) == 2
    assert any(r["reward/std"] > 0 for r in sync)  # the values say something
    assert all(r["reward/errors/tests.trainers.toy_rewards.digits_async"] == 0 for r in both)


@pytest.mark.slow
def test_an_async_reward_in_the_sampler_process(toy_world, tmp_path) -> None:
    sync = _grpo_history(toy_world, tmp_path / "sync", "tests.trainers.toy_rewards:digits")
    got = _grpo_history(toy_world, tmp_path / "async", "tests.trainers.toy_rewards:digits_async",
                        async_rollouts=True, max_staleness=0)
    assert _rewards(got) == _rewards(sync)


def test_a_remote_reward_trains_the_toy_task_as_the_same_function_in_process(toy_world,
                                                                            tmp_path) -> None:
    from tests.rewards.http_stub import serve
    from tests.trainers.toy_rewards import digits

    sync = _grpo_history(toy_world, tmp_path / "sync", "tests.trainers.toy_rewards:digits")
    with serve(lambda p, b: (200, {"scores": [digits(c) for c in b["completions"]]})) as stub:
        got = _grpo_history(toy_world, tmp_path / "remote", {"name": "remote", "url": stub.url})
    assert _rewards(got) == _rewards(sync)
    assert len(stub.bodies) == 2  # one request per step (no held-out data here)
    assert all(r["reward/remote/latency_s_mean"] > 0 for r in got)


def test_a_judge_reward_trains_the_toy_task_as_the_same_rule_in_process(toy_world,
                                                                       tmp_path) -> None:
    from tests.rewards.http_stub import serve
    from tests.rewards.test_judge_reward import graded

    def digit_judge(path: str, body: dict) -> tuple[int, dict]:  # `digits` as a judge: N of 8
        n = sum(ch.isdigit() for ch in graded(body)[:8])
        return 200, {"choices": [{"message": {"content": f"SCORE: {n}"}}]}

    sync = _grpo_history(toy_world, tmp_path / "sync", "tests.trainers.toy_rewards:digits")
    with serve(digit_judge) as stub:
        entry = {"name": "judge", "url": stub.url, "model": "stub", "max_score": 8,
                 "rubric": "One point per digit among the first 8 characters."}
        got = _grpo_history(toy_world, tmp_path / "judge", entry)
    assert _rewards(got) == _rewards(sync)
    assert all(r["reward/errors/judge"] == 0 for r in got) and stub.bodies


def _hacked_run(toy_world, out, audit: str) -> list[dict]:
    keys = {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "lr": 3e-2,
            "max_steps": 12, "audit_rewards": [{"name": audit}], "audit_samples": 8}
    _grpo(toy_world, out, rewards=["tests.trainers.toy_rewards:digits"], **keys).train()
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_tripwire_says_when_the_reward_is_gamed_against_the_audit(toy_world, tmp_path,
                                                                      capsys) -> None:
    rows = _hacked_run(toy_world, tmp_path / "run", "tests.trainers.toy_rewards:not_digits")
    err = [x for x in capsys.readouterr().err.splitlines() if "audit reward falls" in x]
    assert len(err) == 1, err  # one line, naming the steps
    step = int(err[0].split("(step ")[1].split(")")[0])
    audit = [r["reward/audit_mean"] for r in rows]
    assert audit[step - 1] < audit[0] and rows[step - 1]["reward/mean"] > rows[0]["reward/mean"]
    assert all(abs(r["reward/audit_gap"] - (r["reward/audit_train_mean"] -
                                            r["reward/audit_mean"])) < 1e-9 for r in rows)
    print(err[0], [round(a, 3) for a in audit], file=sys.stderr)


def test_no_tripwire_when_the_audit_agrees(toy_world, tmp_path, capsys) -> None:
    rows = _hacked_run(toy_world, tmp_path / "run", "tests.trainers.toy_rewards:digits")
    assert "audit reward falls" not in capsys.readouterr().err
    assert rows[-1]["reward/audit_mean"] > rows[0]["reward/audit_mean"]  # it did learn


def test_overoptimised_is_a_rise_against_a_fall_over_the_window() -> None:
    from posttrain.engine.step_notes import overoptimised

    def rows(train: list[float], audit: list[float]) -> list[dict]:
        return [{"step": s, "reward/mean": t, "reward/audit_mean": a}
                for s, (t, a) in enumerate(zip(train, audit, strict=True), 1)]

    # halves: training 0.1 -> 0.3 (+0.2), audit 0.9 -> 0.7 (-0.2): said, with the steps
    got = overoptimised(rows([0.1] * 3 + [0.3] * 3, [0.9] * 3 + [0.7] * 3))
    assert got == ("reward/mean 0.1 -> 0.3 while reward/audit_mean 0.9 -> 0.7 (steps 1-6)")
    assert overoptimised(rows([0.1] * 3 + [0.3] * 3, [0.9] * 3 + [0.88] * 3)) is None  # -0.02
    assert overoptimised(rows([0.1] * 3 + [0.3] * 3, [0.7] * 3 + [0.9] * 3)) is None  # agree
    assert overoptimised(rows([0.1] * 2 + [0.3] * 3, [0.9] * 2 + [0.7] * 3)) is None  # 5 steps
    nan = rows([0.1] * 3 + [0.3] * 3, [0.9] * 3 + [0.7] * 3)
    nan[4]["reward/audit_mean"] = float("nan")
    assert overoptimised(nan) is None
