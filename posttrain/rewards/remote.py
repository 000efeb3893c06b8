"""The `remote` reward: a batch of samples posted as JSON to a reward server, its scores read.

Wire format (docs/rewards.md, "Remote rewards"): one POST per chunk of `batch_size` samples,
body ``{"prompts": [...], "completions": [...], "<field>": [...], ...}`` (TRL's reward-function
arguments: each row field as a list), answer ``{"scores": [number | null, ...]}`` (``rewards``,
OpenRLHF's key, is read too), one value per sample. A connection error, a timeout, HTTP 429
and 5xx are retried `retries` times with backoff (0.5 s doubling); at most `max_in_flight`
requests of a call are open at once; a chunk that still fails, or answers in another shape, is
an error of each of its samples (`reward_on_error`). Latency and retries are drained into the
step's metrics by `Rewards` (`reward/<name>/latency_s_mean`, ...). Stdlib only (urllib).
"""

from __future__ import annotations

import inspect
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

BACKOFF_S = 0.5
_RETRIED = (429, 500, 502, 503, 504)
NOT_SENT = ("environments",)
"""Row fields a multi-turn rollout adds that are objects, not data: never posted."""


class RemoteRewardError(RuntimeError):
    """A request that failed after its retries, or an answer of the wrong shape."""


class Stats:
    """Latency, request and retry counts per URL, drained into each step's metrics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_url: dict[str, dict[str, list[float]]] = {}

    def add(self, url: str, key: str, value: float) -> None:
        with self.lock:
            self.by_url.setdefault(url, {}).setdefault(key, []).append(value)

    def drain(self, url: str) -> dict[str, float]:
        """`latency_s_mean`, `latency_s_max`, and the sum of every other key, since the last
        drain of `url` (empty when nothing was sent)."""
        with self.lock:
            got = self.by_url.pop(url, {})
        out = {k: float(sum(v)) for k, v in got.items() if k != "latency_s"}
        if got.get("latency_s"):
            lat = got["latency_s"]
            out.update(latency_s_mean=sum(lat) / len(lat), latency_s_max=max(lat))
        return out


STATS = Stats()


def post_json(url: str, payload: Any, *, timeout_s: float, retries: int,
              headers: dict[str, str] | None = None) -> Any:
    """The JSON answer of one POST, retried on a connection error, a timeout, 429 and 5xx;
    raises :class:`RemoteRewardError` naming the URL and the last failure."""
    body = json.dumps(payload, default=str).encode()
    heads = {"Content-Type": "application/json", **(headers or {})}
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            STATS.add(url, "retries", 1.0)
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        t0 = time.monotonic()
        try:
            request = urllib.request.Request(url, body, heads, method="POST")
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read()
            STATS.add(url, "latency_s", time.monotonic() - t0)
            STATS.add(url, "requests", 1.0)
            return json.loads(text)
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code} {err.reason}"
            if err.code not in _RETRIED:
                break
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
            last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        except json.JSONDecodeError as err:
            raise RemoteRewardError(f"{url} answered with text that is not JSON: {err}") from err
    raise RemoteRewardError(f"POST {url} failed after {attempt + 1} attempt(s): {last}")


def remote_reward(completions: Sequence[str], rows: Sequence[dict[str, Any]], *, url: str,
                  timeout_s: float = 30.0, retries: int = 3, batch_size: int = 0,
                  max_in_flight: int = 4, headers: dict[str, str] | None = None
                  ) -> list[float | None | Exception]:
    """The server's score of each sample (None: it does not score the sample); a chunk's
    failure is the exception of each of its samples. `batch_size` 0: one request per call."""
    size = batch_size or max(1, len(completions))
    chunks = [list(range(i, min(i + size, len(completions))))
              for i in range(0, len(completions), size)]

    def one(idx: list[int]) -> list[Any]:
        payload = {"prompts": [rows[i].get("prompt") for i in idx],
                   "completions": [completions[i] for i in idx]}
        for key in sorted({k for i in idx for k in rows[i]} - {"prompt", *NOT_SENT}):
            payload[key] = [rows[i].get(key) for i in idx]
        try:
            return read_scores(post_json(url, payload, timeout_s=timeout_s, retries=retries,
                                         headers=headers), len(idx), url)
        except RemoteRewardError as err:
            return [err] * len(idx)

    with ThreadPoolExecutor(max_workers=max_in_flight) as pool:
        return [v for got in pool.map(one, chunks) for v in got]


def read_scores(answer: Any, n: int, url: str) -> list[float | None]:
    """The `scores` (or `rewards`) list of an answer, checked: `n` numbers or nulls."""
    scores = answer.get("scores", answer.get("rewards")) if isinstance(answer, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        raise RemoteRewardError(f"{url} must answer {{\"scores\": [...]}} with {n} values, got "
                                f"{json.dumps(answer, default=str)[:200]}")
    bad = [s for s in scores if s is not None and (isinstance(s, bool) or not isinstance(
        s, (int, float)))]
    if bad:
        raise RemoteRewardError(f"{url}: a score must be a number or null, got {bad[0]!r}")
    return [None if s is None else float(s) for s in scores]


def check_keys(name: str, fn: Callable[..., Any], kwargs: dict[str, Any],
               limits: dict[str, float]) -> None:
    """A recipe entry of a calling reward: its keys, `url` (http or https) and each key of
    `limits` at least its value; one line naming the key."""
    valid = [p.name for p in list(inspect.signature(fn).parameters.values())[2:]]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"reward {name!r}: unknown key(s) {unknown}; valid: {valid}")
    url = kwargs.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"reward {name!r}: key 'url' is required: the endpoint, http(s)://...")
    for key, low in limits.items():
        value = kwargs.get(key, low)
        kinds = (int,) if isinstance(low, int) else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or \
                not math.isfinite(value) or value < low:
            raise ValueError(f"reward {name!r}: {key}={value!r}; expected a number >= {low}")


remote_reward.batched = True  # type: ignore[attr-defined]
remote_reward.validate_kwargs = lambda kwargs: check_keys(  # type: ignore[attr-defined]
    "remote", remote_reward, kwargs,
    {"timeout_s": 0.001, "retries": 0, "batch_size": 0, "max_in_flight": 1})
remote_reward.drain_metrics = lambda kwargs: STATS.drain(kwargs["url"])  # type: ignore
