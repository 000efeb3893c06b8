"""Math correctness reward: extract the final answer, compare by math equivalence (formulas §10).

``math_reward(completion, answer)`` returns 1.0 when the completion's final answer equals the
gold answer, else 0.0. Extraction, after the last ``</think>`` (the answer, not the thinking):
the last ``<answer>...</answer>`` block (its last ``\\boxed{}`` if it holds one), else the last
``\\boxed{...}`` (balanced braces); none -> 0.0.
Comparison:
1. plain decimal numbers (after removing spaces, commas, ``$``) compare exactly as
   :class:`decimal.Decimal` (``"0.5" == "0.50"``); no rounding, no math-verify;
2. otherwise math-verify (``parse`` + ``verify``) in a worker *process* the caller kills after
   ``timeout_s`` (a hard limit from any thread, even inside long C-level arithmetic).
A gold answer that cannot be parsed in time raises :class:`UnscorableError` (the sample is
excluded and counted); a prediction that does not parse or times out scores 0.0.
More: docs/rewards.md, "Module notes", posttrain.rewards.math.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path

from posttrain.rewards.errors import UnscorableError

logger = logging.getLogger(__name__)

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_WORKER_PATH = Path(__file__).with_name("_verify_worker.py")
_STARTUP_TIMEOUT_S = 60.0


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{") : i]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try the previous one
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion (see the module docstring), stripped; None if absent."""
    completion = completion.rsplit("</think>", 1)[-1]  # a thinking model's answer follows it
    tagged = _ANSWER_RE.findall(completion)
    if tagged:
        content = tagged[-1]
        boxed = last_boxed(content)
        answer = (boxed if boxed is not None else content).strip()
    else:
        boxed = last_boxed(completion)
        answer = boxed.strip() if boxed is not None else ""
    return answer or None


def plain_number(text: str) -> Decimal | None:
    """``text`` as an exact Decimal if it is a plain number (spaces, ``,`` and ``$`` ignored)."""
    cleaned = re.sub(r"[\s,$]", "", text)
    if not _NUMBER_RE.fullmatch(cleaned):
        return None
    try:
        return Decimal(cleaned)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid literals
        return None


class _Worker:
    """One ``_verify_worker.py`` process, used by one thread at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            # -c from "/": running the file by path would put this package's directory first
            # on sys.path, where our math.py would shadow the standard library's math
            [sys.executable, "-u", "-c", _WORKER_PATH.read_text()],
            cwd="/",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._buffer = b""
        ready = self._read_message(time.monotonic() + _STARTUP_TIMEOUT_S)
        if ready != {"ready": True}:
            self.kill()
            raise RuntimeError(f"math-verify worker failed to start ({_WORKER_PATH}): {ready!r}")

    def _read_message(self, deadline: float) -> dict | None:
        """Next JSON line from the worker, or None on deadline / worker death."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def check(self, gold: str, pred: str, timeout_s: float) -> tuple[str, bool]:
        """Send one request; returns (result, gold_parsed). result 'timeout' if past the limit."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"gold": gold, "pred": pred}) + "\n").encode())
        self.proc.stdin.flush()
        gold_ok = False
        while True:
            message = self._read_message(deadline)
            if message is None:
                return ("timeout" if self.proc.poll() is None else "died"), gold_ok
            if message.get("gold_ok"):
                gold_ok = True
                continue
            return str(message["result"]), gold_ok

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class _VerifierPool:
    """Idle workers kept for reuse; a worker past its deadline is killed, never reused."""

    def __init__(self, max_idle: int) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._max_idle = max_idle

    def check(self, gold: str, pred: str, timeout_s: float) -> tuple[str, bool]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker()
        try:
            result, gold_ok = worker.check(gold, pred, timeout_s)
        except BaseException:
            worker.kill()
            raise
        if result in ("timeout", "died"):
            worker.kill()
            return result, gold_ok
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(worker)
                worker = None
        if worker is not None:
            worker.kill()
        return result, gold_ok

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_POOL = _VerifierPool(max_idle=os.cpu_count() or 1)
atexit.register(_POOL.close)


def math_equal(gold: str, pred: str, timeout_s: float = 5.0) -> bool:
    """True if ``pred`` equals ``gold`` mathematically; raises UnscorableError for a bad gold."""
    gold_number, pred_number = plain_number(gold), plain_number(pred)
    if gold_number is not None and pred_number is not None:
        return gold_number == pred_number  # exact fast path, no math-verify
    result, gold_ok = _POOL.check(gold, pred, timeout_s)
    if result == "gold_unparseable" or (result in ("timeout", "died") and not gold_ok):
        raise UnscorableError(f"gold answer {gold[:200]!r} cannot be parsed ({result})")
    if result in ("timeout", "died", "error"):
        logger.warning("math-verify %s on prediction %r: scored 0.0", result, pred[:200])
    return result == "equal"


def math_reward(completion: str, answer: str, *, timeout_s: float = 5.0) -> float:
    """1.0 if the completion's final answer equals ``answer`` (math equivalence), else 0.0.

    Raises UnscorableError if ``answer`` (the gold) is empty or cannot be parsed.
    ``timeout_s`` is a hard wall-clock limit on the math-verify check, from any thread.
    """
    gold = str(answer).strip()
    if not gold:
        raise UnscorableError("gold answer is empty")
    pred = extract_answer(completion)
    if pred is None:
        if plain_number(gold) is not None:
            return 0.0
        pred = ""  # still check the gold parses: a row is unscorable for every sample or none
    return 1.0 if math_equal(gold, pred, timeout_s=timeout_s) else 0.0
