"""Issue 59 item 1: `async def` rewards (and async `get_reward`) are awaited, together within a
step, each within `reward_timeout_s`; in the synchronous trainer and in the sampler process."""

from __future__ import annotations

import asyncio

from posttrain.rewards.registry import Rewards, RewardSpec, environment_reward

_LIVE = {"now": 0, "most": 0}


async def slow_len(completion: str) -> float:
    _LIVE["now"] += 1
    _LIVE["most"] = max(_LIVE["most"], _LIVE["now"])
    await asyncio.sleep(0.05)
    _LIVE["now"] -= 1
    return float(len(completion))


async def hangs_on_b(completion: str) -> float:
    if "b" in completion:
        await asyncio.sleep(30)
    return 1.0


async def batched_async(completions: list[str], answer: list[str]) -> list[float]:
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def test_async_per_sample_rewards_are_awaited_together() -> None:
    _LIVE.update(now=0, most=0)
    result = Rewards([RewardSpec("slow", fn=slow_len)], max_workers=1).score(
        ["a", "bb", "ccc", "dddd"], [{}] * 4)
    assert result.scores == [1.0, 2.0, 3.0, 4.0] and not result.errors
    assert _LIVE["most"] == 4  # all four in flight at once, with a single worker thread


def test_an_async_reward_past_the_timeout_is_an_error_of_that_sample() -> None:
    scorer = Rewards([RewardSpec("hang", fn=hangs_on_b)], on_error="zero", timeout_s=0.2)
    result = scorer.score(["a", "b", "c"], [{}] * 3)
    assert result.scores == [1.0, 0.0, 1.0]
    (err,) = result.errors
    assert err["index"] == 1 and "reward_timeout_s=0.2" in err["error"]


def test_a_batched_async_reward_and_an_async_get_reward() -> None:
    result = Rewards([RewardSpec("b", fn=batched_async)]).score(
        ["7", "8"], [{"answer": "7"}, {"answer": "7"}])
    assert result.scores == [1.0, 0.0]

    class Env:
        async def get_reward(self) -> float:
            await asyncio.sleep(0)
            return 0.5

    class Plain:
        def get_reward(self) -> float:
            return 0.25

    scorer = Rewards(["environment"])
    rows = [{"environments": e} for e in (Env(), Plain(), object())]
    got = scorer.score(["x"] * 3, rows)
    assert got.per_function["environment"][:2] == [0.5, 0.25]
    assert got.metrics["reward/unscored"] == 1.0  # no get_reward: not scored
    assert environment_reward(["x"], [Env()]) == [0.5]  # the synchronous form
