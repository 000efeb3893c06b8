"""Forged reports (issue 9): a supervisor entirely under the program's control. The parent reads
only answers of the exact protocol (posttrain.rewards.sandbox_io) and judges value tests itself,
so a report that is malformed, oversized, short, extra or claims a pass scores 0."""

from __future__ import annotations

import pytest

from posttrain.rewards import sandbox as sandbox_module
from tests.rewards.test_sandbox_adversarial import VALUE_TESTS, mode, run_case

__all__ = ["mode"]  # the fixture: bwrap and limits mode

_FAKE_SUPERVISOR = """
import json, os, sys
fd = int(sys.argv[-1])
data = b''
def lines():
    global data
    while True:
        while b'\\n' not in data:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            data += chunk
        line, data = data.split(b'\\n', 1)
        yield line
def answer(status='returned', value=None, **extra):
    body = {'status': status, 'top': True, 'value': value, 'stdout': None, 'truncated': False}
    body.update(extra)
    return (json.dumps(body) + '\\n').encode()
commands = lines()
next(commands)
os.write(fd, HELLO)
for line in commands:
    test = json.loads(line)
    os.write(fd, (RESPOND)(test))
os.write(fd, TAIL)
"""
_TRUE = {"f(1)": "5", "f(2)": "7", "f(3)": "9"}
FORGED_REPORTS = {  # name: (hello, respond(test) as source, tail, expected status)
    "honest_fake": (b"R\n", f"lambda t: answer(value={_TRUE}[t['expr']])", b"", "passed"),
    "passed_for_value_test": (b"R\n", "lambda t: answer('passed')", b"", "sandbox_error"),
    "two_answers_per_test": (b"R\n", f"lambda t: answer(value={_TRUE}[t['expr']]) * 2", b"",
                             "sandbox_error"),
    "oversized_answer": (b"R\n", "lambda t: answer(value='5' + ' ' * (1 << 21))", b"",
                         "sandbox_error"),
    "unterminated_answer": (b"R\n", "lambda t: os.write(fd, answer(value='5')[:-1]) and "
                            "os._exit(0)", b"", "sandbox_error"),
    "extra_key": (b"R\n", "lambda t: answer(value='5', verdict='passed')", b"",
                  "sandbox_error"),
    "value_not_a_string": (b"R\n", "lambda t: answer(value=5)", b"", "sandbox_error"),
    "top_not_a_bool": (b"R\n", "lambda t: answer(value='5', top=1)", b"", "sandbox_error"),
    "not_json": (b"R\n", "lambda t: b'passed\\n'", b"", "sandbox_error"),
    "garbage_before_start": (b"PASS\nR\n", "lambda t: answer(value='5')", b"",
                             "sandbox_error"),
    "bytes_after_last_answer": (b"R\n", f"lambda t: answer(value={_TRUE}[t['expr']])",
                                b"{}\n", "sandbox_error"),
    "short_report": (b"R\n", "lambda t: os._exit(0)", b"", "crashed"),
    "value_not_plain_data": (b"R\n", "lambda t: answer(value='{5}')", b"", "failed"),
    "lying_value_text": (b"R\n", "lambda t: answer(value='__import__(\"os\")')", b"",
                         "failed"),
}


@pytest.mark.parametrize("case", sorted(FORGED_REPORTS))
def test_forged_reports_score_zero(case: str, mode: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor entirely under the program's control: only answers of the exact protocol
    are read, and a value test passes only with the right value (here known to the fake)."""
    hello, respond, tail, expected = FORGED_REPORTS[case]
    source = (_FAKE_SUPERVISOR.replace("HELLO", repr(hello)).replace("RESPOND", respond)
              .replace("TAIL", repr(tail)))
    monkeypatch.setattr(sandbox_module, "_HARNESS_SOURCE", source)
    score, status = run_case("def f(x):\n    return 0\n", VALUE_TESTS, mode, partial=True)
    assert status == expected
    assert score == (1.0 if expected == "passed" else 0.0)
