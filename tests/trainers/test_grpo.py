"""GRPO trainer: tiny end-to-end runs that must learn, trainer-level properties, bad input."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, GRPOConfig, build_config
from posttrain.data import DataError
from posttrain.trainers.grpo import GRPOTrainer

TOY_REWARD = [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]




def _cfg(world: dict[str, str], out: str, **kw) -> GRPOConfig:
    base = {"model": world["model"], "train_data": world["data"], "out_dir": out,
            "rewards": TOY_REWARD, "group_size": 8, "prompts_per_step": 8,
            "max_new_tokens": 8, "lr": 1e-2, "max_steps": 12, "progress": False,
            "seed": 0, "threads": 1}
    return build_config(GRPOConfig, overrides={**base, **kw})


def _reward_curve(out: str) -> list[float]:
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def _assert_learns(curve: list[float]) -> None:
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    # a random 100-token policy writes '7' about 1% of the time; learning must beat that clearly
    assert last > first + 0.1 and last > 4 * first, f"reward did not rise: {curve}"


def test_grpo_learns_toy_reward(toy_world, tmp_path):
    summary = GRPOTrainer(_cfg(toy_world, str(tmp_path))).train()
    _assert_learns(_reward_curve(str(tmp_path)))
    assert (tmp_path / "final" / "model.safetensors").is_file()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["seconds"] > 0 and saved["peak_rss_mb"] > 0 and summary["steps"] == 12


PRESETS = {
    "gspo": {"ratio_level": "sequence", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4,
             "mini_batches": 4},
    "dapo": {"clip_eps_high": 0.28, "dynamic_sampling": True, "loss_agg": "token-mean",
             "mask_truncated_completions": False, "mini_batches": 2},
    "dr_grpo": {"scale": "none", "loss_agg": "seq-mean-token-sum-norm", "lr": 3e-2},
    "grpo_kl_k3": {"kl_coef": 0.04, "kl_estimator": "k3"},
    "kl_in_reward_k1": {"kl_coef": 0.01, "kl_estimator": "k1", "kl_placement": "reward"},
    "rloo_gspo_token": {"advantage": "rloo", "ratio_level": "sequence_token",
                        "num_iterations": 2, "old_logprobs": "recompute"},
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_learn_toy_reward(toy_world, tmp_path, preset):
    trainer = GRPOTrainer(_cfg(toy_world, str(tmp_path), **{"max_steps": 16, **PRESETS[preset]}))
    assert (trainer.ref.model is not None) == (PRESETS[preset].get("kl_coef", 0) > 0)
    trainer.train()
    _assert_learns(_reward_curve(str(tmp_path)))


def test_beta_zero_loads_no_reference(toy_world, tmp_path):
    assert GRPOTrainer(_cfg(toy_world, str(tmp_path), kl_coef=0.0)).ref.model is None


def test_gradient_accumulation_equals_one_batch(toy_world, tmp_path):
    """One optimizer step with micro-batches of 8 equals one with a single batch of 64."""
    trainer = GRPOTrainer(_cfg(toy_world, str(tmp_path), loss_agg="token-mean",
                               max_grad_norm=0.0))
    rollout, metrics = trainer.rollout_step()
    trainer.compute_advantages(rollout, metrics)
    assert rollout.advantages.abs().sum() > 0  # otherwise the test would prove nothing
    start = copy.deepcopy(trainer.model.state_dict())
    results = []
    for micro in (64, 8):
        trainer.model.load_state_dict(start)
        trainer.opt, trainer.sched = torch.optim.SGD(trainer.model.parameters(), lr=1.0), None
        trainer.sched = torch.optim.lr_scheduler.LambdaLR(trainer.opt, lambda _: 1.0)
        trainer.cfg.micro_batch_size = micro
        trainer.update(rollout)
        results.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    for k in start:
        assert torch.allclose(results[0][k], results[1][k], atol=1e-6), k
    assert any(not torch.equal(results[0][k], start[k]) for k in start)


def test_reward_crash_is_counted_not_swallowed(toy_world, tmp_path):
    rewards = [{"name": "tests.trainers.toy_rewards:crash_on_a", "weight": 1.0}]
    cfg = _cfg(toy_world, str(tmp_path), rewards=rewards, max_steps=1)
    trainer = GRPOTrainer(cfg)
    _, metrics = trainer.rollout_step()
    crashed = sum(v for k, v in metrics.items() if k.startswith("reward/errors"))
    logged = (tmp_path / "reward_errors.jsonl")
    n_logged = len(logged.read_text().splitlines()) if logged.exists() else 0
    # a random policy over ~100 characters writes an 'a' in some of 64 completions
    assert crashed > 0 and crashed == n_logged
    raising = GRPOTrainer(_cfg(toy_world, str(tmp_path / "r"), rewards=rewards,
                               reward_on_error="raise"))
    with pytest.raises(Exception, match="crash"):
        raising.rollout_step()


def test_bad_input_fails_before_model_load(toy_world, tmp_path):
    with pytest.raises(ConfigError, match="group_size"):
        _cfg(toy_world, str(tmp_path), group_size=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"answer": "2"})
                   + "\n")
    with pytest.raises(DataError) as err:
        GRPOTrainer(_cfg(toy_world, str(tmp_path), train_data=str(bad), model="/nonexistent"))
    assert "bad.jsonl" in str(err.value) and "2" in str(err.value) and "prompt" in str(err.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError):
        GRPOTrainer(_cfg(toy_world, str(tmp_path), train_data=str(empty), model="/nonexistent"))
    with pytest.raises(ValueError, match="math"):
        GRPOTrainer(_cfg(toy_world, str(tmp_path), rewards=[{"name": "nope"}],
                         model="/nonexistent"))


def test_lora_grpo_uses_adapters_off_as_reference_and_saves_merged(toy_world, tmp_path):
    """LoRA: no reference copy is loaded; reference log-probs == the base model's after the
    adapters have moved; the final checkpoint is a plain merged model that from_pretrained
    loads and that differs from the base. (Reward learning is asserted for full fine-tuning
    above; this 1-layer toy model barely moves its reward through rank-8 adapters in 16 steps.)"""
    from transformers import AutoModelForCausalLM

    from posttrain.engine.forward import DEFAULT_FORWARD

    cfg = _cfg(toy_world, str(tmp_path), lora_r=8, lora_alpha=32, kl_coef=0.04, lr=3e-2,
               max_steps=16, lora_target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    trainer = GRPOTrainer(cfg)
    assert trainer.ref.model is None
    rollout, metrics = trainer.rollout_step()
    trainer.compute_advantages(rollout, metrics)
    base = AutoModelForCausalLM.from_pretrained(toy_world["model"]).eval()
    expected = DEFAULT_FORWARD.batched(base, rollout.prompt_ids, rollout.prompt_mask,
                                       rollout.completion_ids, rollout.response_mask, 64)
    trainer.update(rollout)  # adapters are non-zero after a step, the reference must not move
    rollout2, metrics2 = trainer.rollout_step()
    trainer.compute_advantages(rollout, metrics2)
    assert torch.allclose(rollout.ref_logprobs, expected, atol=1e-5)
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # zero-initialised, now trained
    trainer.train()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not any("lora" in name for name, _ in reloaded.named_parameters())
    changed = [not torch.equal(a, b) for a, b in zip(reloaded.parameters(), base.parameters(),
                                                        strict=True)]
    assert any(changed) and not all(changed)  # adapted layers merged, the rest untouched


@pytest.mark.parametrize("autocast", [False, True])
def test_off_policy_first_update_starts_at_ratio_one(toy_world, tmp_path, autocast):
    """With several mini-batches the first mini-batch's ratios are 1 (to float tolerance), so
    even GSPO's tight clip range (3e-4) clips nothing: fp32 reuses the sampler's log-probs,
    bf16 autocast recomputes them with the training forward. Checked against the training
    forward run on the micro-batch itself (not against the stored values)."""
    trainer = GRPOTrainer(_cfg(toy_world, str(tmp_path), mini_batches=2, autocast_bf16=autocast,
                               ratio_level="token", clip_eps_low=3e-4, clip_eps_high=3e-4))
    rollout, metrics = trainer.rollout_step()
    trainer.compute_advantages(rollout, metrics)
    assert (rollout.old_logprobs is rollout.logprobs) == (not autocast)
    first = torch.arange(rollout.num_sequences)[: rollout.num_sequences // 2]
    mask = trainer.loss_mask(rollout)
    _, out = trainer.micro_loss(rollout.select(first), mask[first], float(mask[first].sum()),
                                float(len(first)))
    assert out["policy/clipfrac"] == 0.0, out
    assert abs(out["policy/ratio_mean"] - 1.0) < 1e-4 and abs(out["policy/approx_kl"]) < 1e-5


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_bf16_compute_learns_and_keeps_fp32_masters(toy_world, tmp_path, compiled):
    """bf16_compute (optionally with torch_compile): the bf16 learner copy trains the fp32
    master weights, which stay fp32 and are what is saved; the reward rises as in fp32."""
    trainer = GRPOTrainer(_cfg(toy_world, str(tmp_path), bf16_compute=True,
                               torch_compile=compiled, kl_coef=0.04))
    trainer.train()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert trainer.learner() is not trainer.model
    _assert_learns(_reward_curve(str(tmp_path)))


def test_bf16_sampler_weights_follow_the_policy(toy_world, tmp_path):
    """Under autocast_bf16 rollouts come from a bf16 copy that equals the policy's current
    weights at every generation (fp32 master weights are what the optimizer updates); the
    run still learns."""
    trainer = GRPOTrainer(_cfg(toy_world, str(tmp_path), autocast_bf16=True))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    sampler, autocast = trainer.sync_sampler().sampling_model()  # the step: synced now
    assert sampler is not trainer.model and autocast is False
    policy = dict(trainer.model.named_parameters(remove_duplicate=False))
    head = trainer.model.get_output_embeddings().weight
    assert sampler.get_output_embeddings().weight is head  # the policy's own fp32 head
    changed = 0
    for name, p in sampler.named_parameters():
        if p is head:
            continue
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, policy[name].detach().to(torch.bfloat16)), name
        changed += not torch.equal(policy[name].detach(), before[name])
        assert policy[name].dtype == torch.float32
    assert changed > 0
    _assert_learns(_reward_curve(str(tmp_path)))
    fp32 = GRPOTrainer(_cfg(toy_world, str(tmp_path / "fp32"), max_steps=1))
    assert fp32.sync_sampler().sampling_model() == (fp32.model, False)


def test_lora_async_at_staleness_0_is_the_synchronous_lora_run(toy_world, tmp_path):
    """Issue 57: `lora_r` with async_rollouts (refused before, while a PeftModel object ran):
    the push copies the whole state dict, adapters included, so at max_staleness 0 the async
    LoRA run samples, scores and trains exactly as the synchronous one."""
    runs = {}
    for name, extra in {"sync": {}, "async": {"async_rollouts": True, "max_staleness": 0}}.items():
        out = str(tmp_path / name)
        GRPOTrainer(_cfg(toy_world, out, lora_r=4, lora_alpha=16, lr=5e-2, max_steps=3,
                         group_size=4, prompts_per_step=4, report_to=[], **extra)).train()
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [{k: v for k, v in r.items() if k.startswith(("reward/", "loss/"))}
                      for r in rows if "reward/mean" in r]
    assert len(runs["sync"]) == 3 and runs["async"] == runs["sync"]
    assert len({r["reward/mean"] for r in runs["sync"]} | {r["loss/policy"]
                                                           for r in runs["sync"]}) > 1
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / n / "final" / "model.safetensors")) for n in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("where", ["torchrun", "gpu"])
def test_async_under_torchrun_or_on_a_gpu_is_refused_before_the_model_loads(toy_world, tmp_path,
                                                                           monkeypatch, where):
    """Issue 58, item 5: the sampler process serves one learner process on the CPU (it copies
    the policy through CPU shared memory): torchrun and a GPU learner are refused in one line
    naming the key, before any model loads."""
    from types import SimpleNamespace

    from posttrain.engine import async_rollout

    monkeypatch.setattr(GRPOTrainer, "load_model", lambda self: pytest.fail("model loaded"))
    if where == "torchrun":
        monkeypatch.setattr("posttrain.engine.trainer.Dist", lambda device: SimpleNamespace(
            world=2, rank=0, is_main=True, enabled=True))
    else:
        monkeypatch.setattr(async_rollout, "resolve_device", lambda device: torch.device("cuda"))
    with pytest.raises(ConfigError) as err:
        GRPOTrainer(_cfg(toy_world, str(tmp_path), async_rollouts=True, max_steps=1))
    msg = str(err.value)
    assert msg.startswith("config key 'async_rollouts': the sampler process runs beside one "
                          "learner process on the CPU") and "\n" not in msg
