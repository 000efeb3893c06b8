"""scripts/check_vllm_api.py reads limits and signatures from source; its readers on snippets
shaped like vLLM's, and a drifted SamplingParams caught."""

from __future__ import annotations

import ast
import importlib.util
import io
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_vllm_api",
                                               ROOT / "scripts" / "check_vllm_api.py")
cv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cv)

VERIFY = '''
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    def _verify_args(self):
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise E()
        if self.repetition_penalty <= 0.0:
            raise E()
        if self.temperature < 0.0:
            raise E()
        if self.temperature > 2.0:
            raise E()
        if not 0.0 < self.top_p <= 1.0:
            raise E()
        if self.top_k < -1:
            raise E()
        if self.max_tokens is not None and self.max_tokens < 1:
            raise E()
'''


def test_bounds_read_the_refusals():
    fn = next(n for n in ast.walk(ast.parse(VERIFY)) if getattr(n, "name", "") == "_verify_args")
    assert cv.bounds(fn, "presence_penalty") == (-2.0, True, 2.0, True)
    assert cv.bounds(fn, "repetition_penalty") == (0.0, False, None, False)
    assert cv.bounds(fn, "temperature") == (0.0, True, 2.0, True)
    assert cv.bounds(fn, "top_p") == (0.0, False, 1.0, True)
    assert cv.bounds(fn, "top_k") == (-1, True, None, False)
    assert cv.bounds(fn, "max_tokens") == (1, True, None, False)


def test_params_and_fields():
    tree = ast.parse("class A:\n    x: int = 1\n    y: str\n"
                     "    def f(self, a, b=2, *, c='k'): pass\n")
    cls = tree.body[0]
    assert cv.fields(cls) == {"x": "1", "y": None}
    assert cv.params(cls.body[2]) == [("a", None), ("b", "2"), ("c", "'k'")]


def test_a_drifted_sampling_params_fails(tmp_path):
    """A release whose temperature limit moved (as 0.10.2 had none) fails the check."""
    drifted = VERIFY.replace("if self.temperature > 2.0:", "if self.temperature > 5.0:")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("vllm/sampling_params.py", drifted)
    wheel = tmp_path / "vllm-0.0.0-py3-none-any.whl"
    wheel.write_bytes(buf.getvalue())
    problems = cv.check_sampling(cv.Source(wheel))
    assert "SamplingParams.temperature limits (0.0, True, 5.0, True) != fake (0.0, True, 2.0, " \
           "True)" in problems
