"""torchrun with 2 CPU ranks (gloo) equals one process: SFT, GRPO, DPO; data parallel, FSDP2.

Tolerance: per-step losses within 1e-5 (absolute), grad norms within 1e-5 (relative), GRPO
rewards equal to 1e-6, final weights within 1e-5 (GRPO: within 1e-3 of each tensor's change,
see the test). The runs compute the same sums in a
different order (each rank sums its half of the batch, then the ranks' sums are added; the
padding of a micro-batch differs), so they agree to float32 rounding (~1e-7 relative per
operation), not bit for bit. GRPO samples are equal because each sequence draws from its own
generator seeded by (seed, step, prompt, sample), whatever rank generates it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import DPOConfig, GRPOConfig, SFTConfig, build_config
from posttrain.models.loading import save_checkpoint
from posttrain.tasks.arithmetic import sft_rows, write_jsonl
from posttrain.tasks.preferences import offline_pairs
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.dpo import DPOTrainer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.sft import SFTTrainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """A 2-layer tiny Llama (so FSDP2 has per-layer groups) and 64 arithmetic SFT rows."""
    root = tmp_path_factory.mktemp("dist")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2,
                             intermediate_size=64, max_position_embeddings=128, seed=0)
    save_checkpoint(model, tok, root / "model")
    data = write_jsonl(sft_rows(64, seed=0), root / "sft.jsonl")
    prompts = write_jsonl([{"prompt": c, "answer": "7"} for c in "abcdefghijklmnop0123456789"],
                          root / "prompts.jsonl")
    pairs = write_jsonl(offline_pairs(16, seed=0, kind="flaw"), root / "pairs.jsonl")
    return {"model": str(root / "model"), "data": str(data), "prompts": str(prompts),
            "pairs": str(pairs)}


def _keys(world: dict[str, str], out: Path, **kw) -> dict:
    return {"model": world["model"], "train_data": world["data"], "out_dir": str(out),
            "batch_size": 8, "micro_batch_size": 2, "max_steps": 4, "threads": 1,
            "report_to": [], "eval_rewards": [], "lr": 3e-3, "lr_schedule": "constant",
            "progress": False, "save_every": 2, **kw}


def torchrun(command: str, keys: dict, nproc: int = 2) -> str:
    """Run `torchrun --standalone --nproc_per_node nproc -m posttrain command k=v ...`."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "posttrain", command] + [
        f"{k}={json.dumps(v)}" for k, v in keys.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def _steps(out: Path, key: str = "loss/sft") -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if key in r]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _assert_close(one: Path, two: Path, start_model: str) -> None:
    a, b = _steps(one), _steps(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss/sft"] == pytest.approx(ra["loss/sft"], abs=1e-5), ra["step"]
        assert rb["train/grad_norm"] == pytest.approx(ra["train/grad_norm"], rel=1e-5)
        assert rb["perf/tokens"] == ra["perf/tokens"]  # the ranks saw the whole batch
    wa, wb = _weights(one / "final"), _weights(two / "final")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=0)
    start = _weights(Path(start_model))
    assert any(not torch.equal(wa[k], w) for k, w in start.items())  # training moved them


@pytest.mark.parametrize("fsdp", [False, True], ids=["data_parallel", "fsdp2"])
def test_sft_two_ranks_equal_one_process(world, tmp_path, fsdp):
    SFTTrainer(build_config(SFTConfig, overrides=_keys(world, tmp_path / "one"))).train()
    out = torchrun("sft", _keys(world, tmp_path / "two", fsdp=fsdp))
    assert out.count("wrote") == 1  # only rank 0 reports and writes
    _assert_close(tmp_path / "one", tmp_path / "two", world["model"])
    state = torch.load(tmp_path / "two" / "checkpoints" / "step-00000004" / "trainer_state.pt",
                       weights_only=False)
    assert state["world_size"] == 2 and len(state["rng"]) == 2


@pytest.mark.slow
def test_fsdp2_resume_under_torchrun(world, tmp_path):
    """4 steps under FSDP2, then resume to 6: equals 6 steps in one process, and EXACTLY (==)
    6 uninterrupted steps under FSDP2. The checkpoint holds each rank's shards of the weights
    and AdamW state in sharded/ (torch.distributed.checkpoint) and a from_pretrained-loadable
    model/ equal to the gathered weights."""
    SFTTrainer(build_config(SFTConfig, overrides=_keys(world, tmp_path / "one",
                                                       max_steps=6))).train()
    torchrun("sft", _keys(world, tmp_path / "two", fsdp=True))
    ckpt = tmp_path / "two" / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["optimizers"]["policy"] == "sharded"  # no gathered optimizer state
    at_4 = _weights(ckpt / "model")
    torchrun("sft", _keys(world, tmp_path / "two", fsdp=True, max_steps=6,
                          resume_from="latest"))
    _assert_close(tmp_path / "one", tmp_path / "two", world["model"])
    torchrun("sft", _keys(world, tmp_path / "whole", fsdp=True, max_steps=6))
    resumed, whole = _steps(tmp_path / "two"), _steps(tmp_path / "whole")
    def values(rows: list[dict]) -> list[dict]:  # not timings nor memory
        return [{k: v for k, v in r.items() if not k.startswith(("perf/", "gpu/", "time"))
                 or k == "perf/tokens"} for r in rows]

    assert values(resumed) == values(whole) and len(whole) == 6
    wr, ww = _weights(tmp_path / "two" / "final"), _weights(tmp_path / "whole" / "final")
    assert wr.keys() == ww.keys() and all(torch.equal(wr[k], ww[k]) for k in wr)
    assert any(not torch.equal(at_4[k], ww[k]) for k in ww)  # steps 5-6 moved the weights


@pytest.mark.slow
def test_fsdp2_start_up_shards_rank0_weights(world, tmp_path):
    """Under FSDP2 only rank 0 reads the weights (rank 1 builds on meta); the sharded policy
    and reference hold exactly the saved weights; bf16 mixed precision gathers the decoder
    layers in bf16 and the root in fp32 (tests/trainers/fsdp_startup_check.py)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=2", str(ROOT / "tests" / "trainers" / "fsdp_startup_check.py"),
            world["model"], world["prompts"], str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    # the two ranks share stdout: their lines may interleave, so read the ranks, not the lines
    assert sorted(re.findall(r"startup ok (\d+)", proc.stdout)) == ["0", "1"]


GRPO = {"rewards": [{"name": "tests.trainers.toy_rewards:digits", "weight": 1.0}],
        "group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8, "lr": 3e-2,
        "kl_coef": 0.04, "micro_batch_size": 4, "num_iterations": 2, "temperature": 1.5}


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["data_parallel", "fsdp2"])
def test_grpo_two_ranks_equal_one_process(world, tmp_path, fsdp):
    """Prompts sharded by rank (all G samples of a prompt on one rank), global normalisers."""
    keys = {**_keys(world, tmp_path / "one", train_data=world["prompts"], max_steps=3,
                    eval_data=world["prompts"], eval_max_new_tokens=8), **GRPO}
    del keys["batch_size"], keys["eval_rewards"]
    if fsdp:  # FSDP2 runs the plain forward (sharing's call count depends on the data)
        keys["share_prompt_prefix"] = False
    GRPOTrainer(build_config(GRPOConfig, overrides=keys)).train()
    torchrun("grpo", {**keys, "out_dir": str(tmp_path / "two"), "fsdp": fsdp})
    a, b = _steps(tmp_path / "one", "reward/mean"), _steps(tmp_path / "two", "reward/mean")
    assert len(a) == len(b) == 3
    assert sum(r["reward/mean"] for r in a) > 0  # some sample scored: rewards are compared
    for ra, rb in zip(a, b, strict=True):
        for k in ("reward/mean", "reward/std", "response/length_mean"):
            assert rb[k] == pytest.approx(ra[k], abs=1e-6), (ra["step"], k)
        assert rb["loss/total"] == pytest.approx(ra["loss/total"], abs=1e-5), ra["step"]
        assert rb["train/grad_norm"] == pytest.approx(ra["train/grad_norm"], rel=1e-5)
    # final weights: relative to how far training moved them. Adam divides each element's
    # gradient by its running RMS, so an element whose gradient is ~0 up to summation-order
    # noise moves by up to lr (3e-2 here) either way: with a reward that scores (`digits`),
    # 24 of 3,328 elements of one matrix differed by up to 6.6e-5 (AVX2 CPU), while a missing
    # or doubled gradient sync moves every tensor by a share of its whole update
    wa, wb = _weights(tmp_path / "one" / "final"), _weights(tmp_path / "two" / "final")
    start = _weights(Path(world["model"]))
    for k in wa:
        moved = (wa[k] - start[k]).norm()
        assert (wb[k] - wa[k]).norm() <= 1e-3 * moved + 1e-6, k
    # held-out greedy evaluation: each rank decodes half of the prompts; gathered, in order
    for when in ("before", "after"):
        one = (tmp_path / "one" / f"eval_{when}.jsonl").read_text().splitlines()
        two = (tmp_path / "two" / f"eval_{when}.jsonl").read_text().splitlines()
        assert len(one) == 26 and [json.loads(x)["completion"] for x in one] == [
            json.loads(x)["completion"] for x in two]
    sa = json.loads((tmp_path / "one" / "summary.json").read_text())
    sb = json.loads((tmp_path / "two" / "summary.json").read_text())
    for k in ("reward_mean", "length_mean", "n"):
        assert sb["eval_after_detail"][k] == pytest.approx(sa["eval_after_detail"][k], abs=1e-6)


@pytest.mark.parametrize("fsdp,bf16_compute", [
    (False, False), pytest.param(True, False, marks=pytest.mark.slow),
    pytest.param(False, True, marks=pytest.mark.slow)],
    ids=["data_parallel", "fsdp2", "data_parallel_bf16_compute"])
def test_dpo_two_ranks_equal_one_process(world, tmp_path, fsdp, bf16_compute):
    """With bf16_compute each rank's bf16 gradients land in its fp32 masters before the
    gradient sum over ranks: 2 ranks still equal 1 process, to bf16 rounding after the first
    update (masters that differ in the last fp32 bit, from the order of the sum, can round to
    neighbouring bf16 values: 1e-5 in the loss at step 3 and 1e-3 in a summed log-prob of
    -139 here, hence 1e-3 absolute / 1e-4 relative; the final weights' difference is
    compared with how far training moved them, as Adam amplifies it where a gradient is ~0)."""
    tol, rel = (1e-3, 1e-4) if bf16_compute else (1e-5, 0.0)
    keys = {**_keys(world, tmp_path / "one", train_data=world["pairs"], batch_size=8,
                    micro_batch_size=2), "max_seq_len": 128, "lr": 1e-3,
            "bf16_compute": bf16_compute,
            "share_prompt_prefix": not fsdp}  # FSDP2 runs the plain forward
    DPOTrainer(build_config(DPOConfig, overrides=keys)).train()
    torchrun("dpo", {**keys, "out_dir": str(tmp_path / "two"), "fsdp": fsdp})
    a, b = _steps(tmp_path / "one", "loss/dpo"), _steps(tmp_path / "two", "loss/dpo")
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b, strict=True):
        for k in ("loss/dpo", "rewards/accuracy", "logps/chosen"):
            assert rb[k] == pytest.approx(ra[k], abs=tol, rel=rel), (ra["step"], k)
        assert rb["train/grad_norm"] == pytest.approx(ra["train/grad_norm"], rel=tol)
    wa, wb = _weights(tmp_path / "one" / "final"), _weights(tmp_path / "two" / "final")
    if bf16_compute:  # the runs' difference is a small fraction of what training moved
        w0 = _weights(Path(world["model"]))
        diff = sum(float((wb[k] - wa[k]).square().sum()) for k in wa) ** 0.5
        moved = sum(float((wa[k] - w0[k]).square().sum()) for k in wa) ** 0.5
        assert diff < 0.01 * moved, (diff, moved)  # 0.13% when written
        return
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=0)
