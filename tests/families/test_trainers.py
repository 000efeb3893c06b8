"""Every trainer x every real family for 2 steps (issue 55, item 8), chat-format rows, the real
tokenizer and template, each through the CLI as a user runs it (``python -m posttrain <command>
key=value``): SFT, GRPO (math reward), PPO, DPO, KTO and the reward model. Checks: each run
finishes with finite losses; the first RL update is on-policy (ratio 1, every KL 0,
sampler/learner gap within fp32 noise); DPO's and KTO's first step starts at the reference
(margins and rewards 0). Turn ends and masks are checked per family in test_turn_ends.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUMS = [(2, 3), (4, 1), (3, 3), (5, 2), (1, 1), (6, 2), (2, 7), (4, 4)]
COMMON = {"max_steps": 2, "threads": 1, "progress": False, "report_to": [], "seed": 0,
          "warmup_steps": 0, "save_every": 0}
RL = {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "micro_batch_size": 8,
      "kl_coef": 0.05, "rewards": [{"name": "math", "weight": 1.0},
                                   {"name": "tests.families.rewards:ascii_share",
                                    "weight": 0.5}]}
ONE_UPDATE = {"grpo": {"num_iterations": 1, "mini_batches": 1},  # the logged ratio: 1 update
              "ppo": {"ppo_epochs": 1, "mini_batches": 1}}
OFFLINE = {"batch_size": 4, "micro_batch_size": 4, "max_seq_len": 96}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def said(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def write_data(root: Path) -> dict[str, str]:
    """Chat-format rows of each kind: 8 small sums."""
    rows: dict[str, list[dict[str, Any]]] = {"sft": [], "prompts": [], "pairs": [],
                                             "unpaired": []}
    for i, (a, b) in enumerate(SUMS):
        q, good, bad = user(f"What is {a}+{b}?"), f"The answer is {a + b}.", f"It is {a + b + 1}."
        rows["sft"].append({"prompt": q, "completion": said(good)})
        rows["prompts"].append({"prompt": q, "answer": str(a + b)})
        rows["pairs"].append({"prompt": q, "chosen": said(good), "rejected": said(bad)})
        rows["unpaired"].append({"prompt": q, "completion": said(good if i % 2 else bad),
                                 "label": bool(i % 2)})
    paths = {}
    for kind, items in rows.items():
        paths[kind] = str(root / f"{kind}.jsonl")
        Path(paths[kind]).write_text("".join(json.dumps(r) + "\n" for r in items))
    return paths


def metrics(out: Path) -> list[dict[str, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def train(command: str, keys: dict[str, Any]) -> list[dict[str, float]]:
    """`python -m posttrain command key=value ...`; its two logged steps, all finite."""
    args = [f"{k}={json.dumps(v)}" for k, v in keys.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "posttrain", command, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (command, done.stderr[-3000:])
    rows = metrics(Path(keys["out_dir"]))
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (command, bad)
    return rows


def check_on_policy(first: dict[str, float]) -> None:
    """The first update: ratio 1, KL 0 (every estimate), sampler and learner agree."""
    assert abs(first["policy/ratio_max"] - 1) < 1e-5 and abs(first["policy/ratio_min"] - 1) < 1e-5
    kls = {k: v for k, v in first.items() if k.startswith("kl/") and k != "kl/coef"}
    assert kls and all(abs(v) < 1e-5 for v in kls.values()), kls
    assert first.get("rollout/logprob_abs_diff", 0.0) < 1e-4, first


@pytest.mark.slow
def test_every_trainer_runs_two_steps(family, family_dir, tmp_path):
    data = write_data(tmp_path)
    base = {**COMMON, "model": str(family_dir)}
    sft = train("sft", {**base, **OFFLINE, "train_data": data["sft"],
                        "out_dir": str(tmp_path / "sft")})
    assert all(math.isfinite(r["loss/sft"]) for r in sft)
    for command in ("grpo", "ppo"):
        rows = train(command, {**base, **RL, **ONE_UPDATE[command],
                               "train_data": data["prompts"], "out_dir": str(tmp_path / command)})
        check_on_policy(rows[0])
        assert rows[0]["reward/std"] > 0, "the rewards should vary"
    dpo = train("dpo", {**base, **OFFLINE, "train_data": data["pairs"],
                        "out_dir": str(tmp_path / "dpo")})
    kto = train("kto", {**base, **OFFLINE, "train_data": data["unpaired"],
                        "out_dir": str(tmp_path / "kto")})
    rm = train("rm", {**base, **OFFLINE, "train_data": data["pairs"],
                      "out_dir": str(tmp_path / "rm")})
    # before any update the policy is the reference: implicit rewards 0, the losses at log 2 / 0.5
    assert dpo[0]["rewards/margin"] == 0 and dpo[0]["rewards/chosen"] == 0, dpo[0]
    assert abs(dpo[0]["loss/dpo"] - math.log(2)) < 1e-6, dpo[0]
    assert kto[0]["kto/reference_point"] == 0 and abs(kto[0]["loss/kto"] - 0.5) < 1e-6, kto[0]
    assert all(math.isfinite(r["loss/rm"]) for r in rm) and rm[0]["train/grad_norm"] > 0
