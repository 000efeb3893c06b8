"""Forged reports (issue 9): a supervisor entirely under the program's control. The parent reads
only answers of the exact protocol (posttrain.sandbox.io) and judges value tests itself,
so a report that is malformed, oversized, short, extra or claims a pass scores 0."""

from __future__ import annotations

import pytest

from posttrain.sandbox import jail as sandbox_module
from tests.sandbox.test_adversarial_programs import VALUE_TESTS, mode, run_case

__all__ = ["mode"]  # the fixture: bwrap and limits mode

_FAKE_SUPERVISOR = """
import json, os, sys
fd = int(sys.argv[-2])
data = b''
count = [0]
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
    body = {'id': count[0], 'status': status, 'top': True, 'value': value, 'stdout': None,
            'truncated': False, 'in_process': False}
    body.update(extra)
    count[0] += 1
    return (json.dumps(body) + '\\n').encode()
commands = lines()
next(commands)
os.write(fd, HELLO)
for line in commands:
    test = json.loads(line)
    os.write(fd, (RESPOND)(test))
os.write(fd, TAIL)
"""
_TRUE = {1: "5", 2: "7", 3: "9"}  # the wire form of 5, 7, 9 by argument
FORGED_REPORTS = {  # name: (hello, respond(test) as source, tail, expected status)
    "honest_fake": (b"R\n", f"lambda t: answer(value={_TRUE}[t['args'][0]])", b"", "passed"),
    "passed_for_value_test": (b"R\n", "lambda t: answer('passed')", b"", "sandbox_error"),
    "two_answers_per_test": (b"R\n", f"lambda t: answer(value={_TRUE}[t['args'][0]]) * 2", b"",
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
    "bytes_after_last_answer": (b"R\n", f"lambda t: answer(value={_TRUE}[t['args'][0]])",
                                b"{}\n", "sandbox_error"),
    "short_report": (b"R\n", "lambda t: os._exit(0)", b"", "crashed"),
    "value_not_plain_data": (b"R\n", "lambda t: answer(value='[\"s\", 5]')", b"", "failed"),
    "lying_value_text": (b"R\n", "lambda t: answer(value='__import__(\"os\")')", b"",
                         "sandbox_error"),
    # issue 23: the framed protocol
    "wrong_id": (b"R\n", f"lambda t: answer(value={_TRUE}[t['args'][0]], id=7)", b"",
                 "sandbox_error"),
    "in_process_claim_for_value": (b"R\n", f"lambda t: answer(value={_TRUE}[t['args'][0]], "
                                   "in_process=True)", b"", "sandbox_error"),
    "value_with_trailing_comment": (b"R\n", "lambda t: answer(value='5#1')", b"",
                                    "sandbox_error"),
    "value_as_json_float": (b"R\n", "lambda t: answer(value='5.0')", b"", "sandbox_error"),
    "value_nan_token": (b"R\n", "lambda t: answer(value='NaN')", b"", "sandbox_error"),
    "infinity_value": (b"R\n", "lambda t: answer(value='[\"f\", \"inf\"]')", b"", "failed"),
    "duplicate_keys": (b"R\n", "lambda t: answer(value='5')[:-2] + b', \"status\": "
                       "\"passed\"}\\n'", b"", "sandbox_error"),
    "id_as_bool": (b"R\n", "lambda t: answer(value='5', id=count[0] == 0)", b"",
                   "sandbox_error"),
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
