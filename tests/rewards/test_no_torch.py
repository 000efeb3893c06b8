"""posttrain.rewards is pure Python: importing it (and scoring) must not import torch."""

from __future__ import annotations

import subprocess
import sys


def test_rewards_import_without_torch() -> None:
    code = ("import sys\n"
            "import posttrain.rewards as r\n"
            "assert r.format_reward('<think>a</think><answer>1</answer>') == 0.1\n"
            "assert r.math_reward('<answer>2</answer>', '2') == 1.0\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
