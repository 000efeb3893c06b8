"""Exact resume and graceful stop (posttrain.engine.checkpoint, the base Trainer loop).

Tolerance: resumed runs must match uninterrupted ones EXACTLY (==) on every metric except
wall-clock ones (`perf/*`, `time`): the same deterministic CPU kernels, one thread, run on the
same weights, optimizer moments, data order and generator states, so any difference is a bug.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, DPOConfig, GRPOConfig, SFTConfig, build_config
from posttrain.engine.checkpoint import (
    find_resume,
    list_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.arithmetic import sft_rows, write_jsonl
from posttrain.tasks.preferences import offline_pairs
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.dpo import DPOTrainer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.sft import SFTTrainer

ROOT = Path(__file__).resolve().parents[2]
TOY_REWARD = [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """A random tiny Llama, 72 one-character GRPO prompts, SFT rows and preference pairs."""
    root = tmp_path_factory.mktemp("resume")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, max_position_embeddings=128, seed=0)
    save_checkpoint(model, tok, root / "model")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c, "answer": "7"}) + "\n"
                               for c in "abcdefghijklmnopqrstuvwxyz0123456789" * 2))
    sft = write_jsonl(sft_rows(64, seed=0), root / "sft.jsonl")
    pairs = write_jsonl(offline_pairs(16, seed=0, kind="flaw"), root / "pairs.jsonl")
    return {"model": str(root / "model"), "prompts": str(prompts), "sft": str(sft),
            "pairs": str(pairs)}


def _grpo_keys(world: dict[str, str], out: Path, **kw) -> dict:
    # 72 prompts / 8 per step: the epoch order is reshuffled after step 9, inside the run;
    # cosine schedule with warm-up, 2 x 2 optimizer steps per rollout: all state that matters
    return {"model": world["model"], "train_data": world["prompts"], "out_dir": str(out),
            "rewards": TOY_REWARD, "group_size": 4, "prompts_per_step": 8,
            "max_new_tokens": 8, "lr": 1e-2, "max_steps": 10, "progress": False, "seed": 3,
            "threads": 1, "save_every": 3, "report_to": [], "lr_schedule": "cosine",
            "warmup_steps": 2, "num_iterations": 2, "mini_batches": 2, **kw}


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith("perf/")}
            for r in rows]


def _same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_grpo_kill_9_then_resume_latest_matches_uninterrupted(world, tmp_path):
    """kill -9 in the middle of step 8 (checkpoints at 3 and 6), resume: identical metrics."""
    full = tmp_path / "full"
    GRPOTrainer(build_config(GRPOConfig, overrides=_grpo_keys(world, full))).train()
    crashed = tmp_path / "crashed"
    keys = _grpo_keys(world, crashed)
    marker = tmp_path / "hanging"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOY_HANG_AT_CALL": str(7 * 32 + 5),
           "TOY_HANG_MARKER": str(marker)}  # 32 completions per step: call 5 of step 8
    argv = [sys.executable, "-m", "posttrain", "grpo"] + [
        f"{k}={json.dumps(v)}" for k, v in keys.items()]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), proc.stdout.read().decode() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert [s for s, _ in list_checkpoints(crashed)] == [3, 6]
    assert max(r["step"] for r in _rows(crashed)) == 7  # step 7 was logged, then lost
    resumed = GRPOTrainer(build_config(GRPOConfig, overrides={**keys, "resume_from": "latest"}))
    assert resumed.start_step == 6
    resumed.train()
    assert [r["step"] for r in _rows(crashed)] == [r["step"] for r in _rows(full)]
    assert _comparable(_rows(crashed)) == _comparable(_rows(full))
    _same_weights(crashed / "final", full / "final")
    summary = json.loads((crashed / "summary.json").read_text())
    assert [h["step"] for h in summary["history"]] == list(range(1, 11))


class _CrashAt(Exception):
    pass


def _crash_at(trainer, at: int):
    """Make `trainer.step(at)` raise (a crash after the previous steps were logged)."""
    step = trainer.step

    def wrapped(n: int):
        if n == at:
            raise _CrashAt
        return step(n)

    trainer.step = wrapped
    return trainer


@pytest.mark.parametrize("kind", ["sft", "dpo", "dpo_bf16_compute"])
def test_same_process_resume_matches_uninterrupted(world, tmp_path, kind):
    """Crash in step 6 (checkpoint at 4, step 5 logged), resume: identical rows and weights
    (with bf16_compute the resumed run's bf16 learner copy is rebuilt from the checkpoint)."""
    if kind == "sft":
        cls, config = SFTTrainer, SFTConfig
        keys = {"train_data": world["sft"], "batch_size": 16, "micro_batch_size": 8,
                "rewards": [], "lr": 3e-3}
    else:
        cls, config = DPOTrainer, DPOConfig
        keys = {"train_data": world["pairs"], "batch_size": 6, "micro_batch_size": 4,
                "lr": 1e-3, "max_seq_len": 128, "rewards": [],
                "bf16_compute": kind == "dpo_bf16_compute"}
    keys.update({"model": world["model"], "max_steps": 8, "save_every": 2, "threads": 1,
                 "progress": False, "report_to": ["tensorboard"], "lr_schedule": "linear",
                 "warmup_steps": 3, "keep_checkpoints": 1})

    def cfg(out: Path, **kw):
        return build_config(config, overrides={**keys, "out_dir": str(out), **kw})

    cls(cfg(tmp_path / "full")).train()
    with pytest.raises(_CrashAt):
        _crash_at(cls(cfg(tmp_path / "run")), 6).train()
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [4]  # keep_checkpoints: 1
    if kind == "dpo_bf16_compute":  # recompute the reference table: the learner copy then
        # exists before the checkpoint loads, and must follow the loaded weights
        shutil.rmtree(tmp_path / "run" / "refcache")
    resumed = cls(cfg(tmp_path / "run", resume_from="latest"))
    assert resumed.start_step == 4
    resumed.train()
    full, run = _rows(tmp_path / "full"), _rows(tmp_path / "run")
    assert [r["step"] for r in run] == [r["step"] for r in full]
    assert _comparable(run) == _comparable(full)
    _same_weights(tmp_path / "run" / "final", tmp_path / "full" / "final")


def test_sigterm_finishes_the_step_checkpoints_and_exits_0(world, tmp_path):
    out = tmp_path / "run"
    keys = _grpo_keys(world, out, max_steps=1000, save_every=0, num_iterations=1,
                      mini_batches=1)
    argv = [sys.executable, "-m", "posttrain", "grpo"] + [
        f"{k}={json.dumps(v)}" for k, v in keys.items()]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            path = out / "metrics.jsonl"
            if path.exists() and any(r.get("step", 0) >= 2 for r in _rows(out)):
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text
    summary = json.loads((out / "summary.json").read_text())
    last = summary["stopped_at_step"]
    assert last >= 2 and max(r["step"] for r in _rows(out)) == last
    assert [s for s, _ in list_checkpoints(out)] == [last]
    assert not (out / "final").exists()
    state = read_checkpoint(list_checkpoints(out)[0][1])
    assert state["step"] == last and len(state["history"]) == last


def test_half_written_checkpoint_is_ignored_and_keep_k(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step, {"step": step}, None, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    # a crash while writing step 4: its temporary directory is never taken for a checkpoint
    (tmp_path / "checkpoints" / ".tmp-step-00000004").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step-00000004" / "trainer_state.pt").write_bytes(b"xx")
    assert find_resume(tmp_path, "latest").name == "step-00000003"
    write_checkpoint(tmp_path, 4, {"step": 4}, None, keep=2)
    assert read_checkpoint(find_resume(tmp_path, "latest"))["step"] == 4
    assert not (tmp_path / "checkpoints" / ".tmp-step-00000004").exists()
    assert find_resume(tmp_path / "empty", "latest") is None
    assert find_resume(tmp_path, "") is None
    with pytest.raises(ConfigError, match="resume_from"):
        find_resume(tmp_path, str(tmp_path / "checkpoints" / "step-00000001"))
