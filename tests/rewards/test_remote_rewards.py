"""Issue 59 item 2: the `remote` reward against a server the test starts on 127.0.0.1: the
wire format, retries with backoff, bounded requests in flight, errors through
`reward_on_error`, latency in the metrics; its entry checked before any work."""

from __future__ import annotations

import time

import pytest

from posttrain.rewards import remote
from posttrain.rewards.registry import Rewards, RewardSpec, validate_specs
from tests.rewards.http_stub import serve


def digit_share(path: str, body: dict) -> tuple[int, dict]:
    return 200, {"scores": [sum(ch.isdigit() for ch in c) / max(1, len(c))
                            for c in body["completions"]]}


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


def _scorer(url: str, on_error: str = "auto", **keys) -> Rewards:
    return Rewards([RewardSpec.from_dict({"name": "remote", "url": url, **keys})],
                        on_error=on_error)


def test_a_batch_is_posted_with_the_row_fields_and_its_scores_read() -> None:
    with serve(digit_share) as stub:
        rows = [{"prompt": "p1", "answer": "7", "environments": object()},
                {"prompt": [{"role": "user", "content": "p2"}], "answer": "8"}]
        result = _scorer(stub.url + "/score").score(["77", "a7"], rows)
    assert result.scores == [1.0, 0.5] and not result.errors
    (body,) = stub.bodies  # one request for the batch, the row's fields as lists
    assert body == {"prompts": ["p1", [{"role": "user", "content": "p2"}]],
                    "completions": ["77", "a7"], "answer": ["7", "8"]}
    assert result.metrics["reward/remote/requests"] == 1.0
    assert result.metrics["reward/remote/latency_s_mean"] > 0


def test_openrlhf_rewards_key_and_null_for_not_scored() -> None:
    with serve(lambda p, b: (200, {"rewards": [1, None]})) as stub:
        result = _scorer(stub.url).score(["a", "b"], [{}, {}])
    assert result.per_function["remote"][0] == 1.0 and result.metrics["reward/unscored"] == 1.0


def test_a_5xx_is_retried_with_backoff_and_a_4xx_is_not() -> None:
    calls = []

    def flaky(path: str, body: dict) -> tuple[int, dict]:
        calls.append(path)
        return (503, {}) if len(calls) < 3 else digit_share(path, body)

    with serve(flaky) as stub:
        result = _scorer(stub.url, retries=3).score(["7"], [{}])
    assert result.scores == [1.0] and result.metrics["reward/remote/retries"] == 2.0
    with serve(lambda p, b: (400, {"detail": "bad"})) as stub:
        result = _scorer(stub.url, on_error="zero", retries=3).score(["7", "8"], [{}, {}])
    assert len(stub.bodies) == 1 and result.scores == [0.0, 0.0]
    assert all("HTTP 400" in e["error"] for e in result.errors)


def test_a_failing_server_stops_the_run_under_auto_with_the_url() -> None:
    from posttrain.rewards import RewardFunctionError

    with serve(lambda p, b: (500, {})) as stub, pytest.raises(RewardFunctionError,
                                                               match="after 2 attempt"):
        _scorer(stub.url, retries=1).score(["7", "8"], [{}, {}])


def test_a_timeout_and_a_wrong_shape_are_errors_of_their_samples() -> None:
    def slow_on_b(path: str, body: dict) -> tuple[int, dict]:
        if body["completions"] == ["b"]:
            time.sleep(1.0)
        if body["completions"] == ["c"]:
            return 200, {"scores": [1, 2]}  # two scores for one sample
        return digit_share(path, body)

    with serve(slow_on_b) as stub:
        result = _scorer(stub.url, on_error="zero", batch_size=1, retries=0,
                         timeout_s=0.2).score(["7", "b", "c"], [{}] * 3)
    assert result.scores == [1.0, 0.0, 0.0]
    by_index = {e["index"]: e["error"] for e in result.errors}
    assert "timed out" in by_index[1] and "with 1 values" in by_index[2]


def test_requests_in_flight_are_bounded() -> None:
    def slow(path: str, body: dict) -> tuple[int, dict]:
        time.sleep(0.05)
        return digit_share(path, body)

    with serve(slow) as stub:
        result = _scorer(stub.url, batch_size=1, max_in_flight=2).score(["7"] * 8, [{}] * 8)
    assert result.scores == [1.0] * 8 and len(stub.bodies) == 8 and stub.most == 2


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "remote"}, "key 'url' is required"),
    ({"name": "remote", "url": "127.0.0.1:9"}, "key 'url' is required"),
    ({"name": "remote", "url": "http://127.0.0.1:9", "tiemout_s": 3},
     r"unknown key\(s\) \['tiemout_s'\]"),
    ({"name": "remote", "url": "http://127.0.0.1:9", "max_in_flight": 0}, "max_in_flight=0"),
])
def test_an_entry_is_checked_before_any_work(entry, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_specs([RewardSpec.from_dict(entry)])
