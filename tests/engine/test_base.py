"""The shared trainer base: every device, the Python API, KL at step 0, step-wide normalisers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from posttrain.engine import update
from posttrain.tasks.arithmetic import prompt_rows, sft_rows
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.dpo import DPOTrainer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.sft import SFTTrainer
from tests.trainers.toy_rewards import sevens

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PRECISIONS = {"fp32": {}, "autocast": {"autocast_bf16": True},
              "bf16_compute": {"bf16_compute": True}}
COMMON = {"progress": False, "threads": 1, "report_to": [], "seed": 0}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny(tok, seed: int = 0):
    return build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                            intermediate_size=64, max_position_embeddings=128, seed=seed)


def toy_prompts(n: int = 16) -> list[dict[str, str]]:
    return [{"prompt": c, "answer": "7"} for c in "abcdefghijklmnopqrstuvwxyz"[:n]]


def pairs(n: int = 8) -> list[dict[str, str]]:
    return [{"prompt": r["prompt"], "chosen": r["completion"],
             "rejected": r["completion"].replace("<answer>", "<answer>1")}
            for r in sft_rows(n, seed=3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_step_of_each_trainer_on_every_device(tok, tmp_path, device, precision):
    """SFT, GRPO and DPO each run a step with the model on `device` (CPU here; CUDA where one
    is present: scripts/gpu_smoke.sh runs the same through the CLI)."""
    kw = {**COMMON, "device": device, **PRECISIONS[precision]}
    if precision != "bf16_compute":  # grpo and dpo only
        sft = SFTTrainer(model=tiny(tok), tokenizer=tok, train_data=sft_rows(16), rewards=[],
                         out_dir=str(tmp_path / "sft"), batch_size=8, **kw)
        assert sft.step(1)["loss/sft"] > 0
    grpo = GRPOTrainer(model=tiny(tok), tokenizer=tok, train_data=prompt_rows(8, seed=1),
                       out_dir=str(tmp_path / "grpo"), group_size=2, prompts_per_step=2,
                       max_new_tokens=6, kl_coef=0.1, mini_batches=2, **kw)
    metrics = grpo.step(1)
    assert metrics["train/grad_norm"] >= 0 and "kl/token_mean" in metrics
    dpo = DPOTrainer(model=tiny(tok), tokenizer=tok, train_data=pairs(), rewards=[],
                     out_dir=str(tmp_path / "dpo"), batch_size=4, micro_batch_size=4, **kw)
    assert 0.0 <= dpo.step(1)["rewards/accuracy"] <= 1.0
    assert next(grpo.model.parameters()).device.type == device


def test_python_api_takes_objects_and_callables(tok, tmp_path):
    """A model object, rows as a list of dicts, a reward callable, config keys as keywords."""
    model = tiny(tok)
    trainer = GRPOTrainer(model=model, tokenizer=tok, train_data=toy_prompts(),
                          eval_data=toy_prompts(4), rewards=[sevens], out_dir=str(tmp_path),
                          group_size=4, prompts_per_step=4, max_new_tokens=8, max_steps=2,
                          eval_size=4, **COMMON)
    assert trainer.model is model and trainer.cfg.max_steps == 2
    summary = trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/sevens_mean" in r] == [1, 2]
    assert summary["eval_after_detail"]["n"] == 4
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_python_api_validates_rows_before_the_model_is_used(tok, tmp_path):
    from posttrain.data import DataError

    with pytest.raises(DataError, match="prompt"):
        GRPOTrainer(model=tiny(tok), tokenizer=tok, train_data=[{"answer": "1"}],
                    rewards=[sevens], out_dir=str(tmp_path), **COMMON)


def _grpo(tok, tmp_path, **kw) -> GRPOTrainer:
    base = {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8, "lr": 1e-2,
            "out_dir": str(tmp_path), **COMMON}
    return GRPOTrainer(model=tiny(tok), tokenizer=tok, train_data=toy_prompts(),
                       rewards=[sevens], **{**base, **kw})


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_kl_is_zero_at_the_first_step(tok, tmp_path, placement, estimator, precision):
    """Before any update the policy IS the reference: KL must be 0 (float tolerance) for every
    placement, estimator and precision. Under bf16 the sampler's log-probs come from a cached
    bf16 decode; comparing them with the reference's training forward gave KL ~1e-2 here.
    Under bf16_compute the reference is a bf16 copy built like the learner's."""
    trainer = _grpo(tok, tmp_path, kl_coef=0.1, kl_placement=placement, kl_estimator=estimator,
                    **PRECISIONS[precision])
    metrics = trainer.step(1)
    key = "kl/token_mean" if placement == "loss" else "kl/seq_mean"
    assert abs(metrics[key]) < 1e-5, metrics[key]


def _truncated_rollout(trainer: GRPOTrainer):
    rollout, metrics = trainer.rollout_step()
    trainer.compute_advantages(rollout, metrics)
    rollout.truncated = torch.zeros_like(rollout.truncated)
    rollout.truncated[[1, 5, 6, 10]] = True  # rows whose every token is masked from the loss
    rollout.advantages = torch.linspace(-1.0, 1.0, rollout.num_sequences)  # non-trivial
    return rollout


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean",
                                      "seq-mean-token-sum-norm"])
def test_masked_truncated_rows_add_nothing_and_accumulation_is_exact(tok, tmp_path, loss_agg,
                                                                     monkeypatch):
    """With mask_truncated_completions, a step over all rows equals a step over the rows that
    count (truncated rows add to no normaliser), and micro-batches of 3 equal one batch."""
    kw = {"loss_agg": loss_agg, "mask_truncated_completions": True, "max_grad_norm": 0.0,
          "lr": 1e-2}
    ref = _grpo(tok, tmp_path / "r", **kw)
    rollout = _truncated_rollout(ref)
    keep = (~rollout.truncated).nonzero()[:, 0]
    grads = []
    for micro, rows in ((64, rollout), (3, rollout), (64, rollout.select(keep))):
        trainer = _grpo(tok, tmp_path / f"{micro}{len(rows.rows)}", micro_batch_size=micro,
                        **kw)
        grads.append([])
        monkeypatch.setattr(update, "step_groups", lambda groups, dist, out=grads[-1]: out.extend(
            p.grad.clone() for p in groups[0].params) or {})  # the gradient, before the step
        trainer.update(rows)
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)


def test_trackio_receives_the_metrics(tmp_path):
    """`report_to: [trackio]` logs every step to trackio's local store (no network)."""
    pytest.importorskip("trackio")
    script = f"""
import json
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.tasks.arithmetic import sft_rows
from posttrain.trainers.sft import SFTTrainer
tok = build_char_tokenizer()
model = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                         max_position_embeddings=128)
SFTTrainer(model=model, tokenizer=tok, train_data=sft_rows(16), rewards=[], max_steps=3,
           batch_size=8, out_dir={str(tmp_path / 'run')!r}, report_to=["trackio"],
           run_name="t1", progress=False).train()
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs("posttrain", "t1")
print(json.dumps([row.get("loss/sft") is not None for row in logs if row.get("step")]))
"""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, True]


def test_optimizer_is_fused_adamw_and_steps_like_the_unfused_one():
    """CPU parameters get PyTorch's fused AdamW (no parameter-sized temporaries); its step
    equals the reference implementation's."""
    from types import SimpleNamespace

    from posttrain.engine.optim import build_optimizer

    tok = build_char_tokenizer()
    cfg = SimpleNamespace(lr=1e-2, adam_betas=[0.9, 0.99], weight_decay=0.1, warmup_steps=0,
                          lr_schedule="constant", min_lr_ratio=0.0)
    models = [build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                               intermediate_size=32, seed=0) for _ in range(2)]
    fused, _ = build_optimizer(models[0], cfg, 10)
    assert fused.defaults["fused"] is True
    plain = torch.optim.AdamW(models[1].parameters(), lr=1e-2, betas=(0.9, 0.99),
                              weight_decay=0.1)
    ids = torch.tensor([[5, 6, 7, 8]])
    for _ in range(3):
        for model, opt in zip(models, (fused, plain), strict=True):
            model(input_ids=ids).logits.square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    assert not torch.equal(models[0].lm_head.weight, build_tiny_llama(
        tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
        seed=0).lm_head.weight)


def test_gradient_checkpointing_gives_the_same_update(tok, tmp_path):
    """gradient_checkpointing recomputes layer activations in the backward pass: one GRPO step
    from the same weights and seed lands on the same weights as without it."""
    after = []
    for ckpt in (False, True):
        trainer = _grpo(tok, tmp_path / str(ckpt), kl_coef=0.1, gradient_checkpointing=ckpt,
                        lr=1e-2)
        flag = getattr(trainer.model, "is_activation_checkpointing", None)
        assert (flag if flag is not None else trainer.model.is_gradient_checkpointing) is ckpt
        trainer.model.train()
        trainer.step(1)
        after.append({k: v.detach().clone() for k, v in trainer.model.named_parameters()})
    before = tiny(tok).state_dict()
    moved = sum(not torch.equal(after[0][k], before[k]) for k in after[0])
    assert moved > 0
    for k in after[0]:
        assert torch.allclose(after[0][k], after[1][k], atol=1e-6), k


def test_freed_memory_is_released_before_the_first_optimizer_step_only(monkeypatch):
    """The update trims the heap once, before AdamW allocates its moments."""
    from types import SimpleNamespace

    from posttrain.engine import optim
    from posttrain.engine.distributed import Dist

    calls = []
    monkeypatch.setattr(update, "release_freed_memory", lambda: calls.append(1))
    tok = build_char_tokenizer()
    model = tiny(tok)
    cfg = SimpleNamespace(lr=1e-3, adam_betas=[0.9, 0.99], weight_decay=0.0, warmup_steps=0,
                          lr_schedule="constant", min_lr_ratio=0.0)
    opt, sched = optim.build_optimizer(model, cfg, 3)
    for _ in range(3):
        model(input_ids=torch.tensor([[5, 6, 7]])).logits.square().mean().backward()
        group = update.OptimGroup("policy", list(model.parameters()), opt, sched, 1.0)
        update.step_groups([group], Dist())
    assert calls == [1]


def test_bf16_on_a_cpu_without_bf16_instructions_is_warned_about(monkeypatch):
    """bf16 matmuls are emulated without AVX512-BF16/AMX (1-2 GFLOP/s on an AVX2-only EPYC):
    the warning names the key; no warning for fp32, on CUDA, or where the CPU has them."""
    from posttrain.config import GRPOConfig
    from posttrain.engine.preflight import slow_bf16_warning

    cpu = torch.device("cpu")
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    assert slow_bf16_warning(GRPOConfig(), cpu) is None
    assert "'autocast_bf16'" in slow_bf16_warning(GRPOConfig(autocast_bf16=True), cpu)
    assert "'bf16_compute'" in slow_bf16_warning(GRPOConfig(bf16_compute=True), cpu)
    assert slow_bf16_warning(GRPOConfig(autocast_bf16=True), torch.device("cuda")) is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert slow_bf16_warning(GRPOConfig(autocast_bf16=True), cpu) is None
