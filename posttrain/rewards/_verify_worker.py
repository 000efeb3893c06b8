"""Math-equivalence worker process: runs math-verify with its signal timeouts disabled.

Started by :mod:`posttrain.rewards.math` as ``python -u -c <this source>``; it imports
only the standard library and ``math_verify`` (never ``posttrain``). The parent enforces the
hard time limit by killing this process, which works from any thread, unlike math-verify's
``signal.alarm`` timeout (main thread only, and blind to long C-level integer arithmetic).

Protocol, one JSON object per line:
  parent -> worker  ``{"gold": str, "pred": str}``
  worker -> parent  ``{"ready": true}`` once at start-up;
                    ``{"gold_ok": true}`` as soon as the gold answer parsed (so the parent can
                    tell a slow gold answer from a slow prediction);
                    ``{"result": "equal" | "not_equal" | "gold_unparseable" |
                    "pred_unparseable" | "error", "detail": str}`` to finish a request.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

_GOLD_CACHE_SIZE = 4096


def _parse(text: str) -> list[Any]:
    """Parse one extracted answer; ``\\boxed{}`` makes bare LaTeX (``\\sqrt{2}``) parse."""
    from math_verify import parse

    return parse("\\boxed{" + text + "}", parsing_timeout=None)


def _handle(request: dict[str, Any], gold_cache: dict[str, list[Any]], send: Any) -> dict:
    from math_verify import verify

    gold_text = str(request["gold"])
    gold = gold_cache.get(gold_text)
    if gold is None:
        gold = _parse(gold_text)
        if all(isinstance(item, str) for item in gold):  # nothing, or only a raw-string fallback
            return {"result": "gold_unparseable", "detail": gold_text[:200]}
        if len(gold_cache) >= _GOLD_CACHE_SIZE:
            gold_cache.clear()
        gold_cache[gold_text] = gold
    send({"gold_ok": True})
    pred = _parse(str(request["pred"]))
    if not pred:
        return {"result": "pred_unparseable", "detail": ""}
    equal = verify(gold, pred, timeout_seconds=None)
    return {"result": "equal" if equal else "not_equal", "detail": ""}


def main() -> None:
    logging.disable(logging.CRITICAL)  # math-verify warns that its timeout is off: on purpose
    import math_verify  # noqa: F401  (import before saying ready: start-up is not request time)

    out = sys.stdout

    def send(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    gold_cache: dict[str, list[Any]] = {}
    send({"ready": True})
    for line in sys.stdin:
        try:
            reply = _handle(json.loads(line), gold_cache, send)
        except Exception as exc:  # a math-verify bug must not kill the worker
            reply = {"result": "error", "detail": repr(exc)[:500]}
        send(reply)


if __name__ == "__main__":
    main()
