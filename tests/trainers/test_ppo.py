"""PPO trainer: reward shaping, masking, first-update ratio, early stop, adaptive KL, learning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

from posttrain.config import ConfigError, build_config
from posttrain.config.ppo import PPOConfig
from posttrain.models.loading import save_checkpoint
from posttrain.ops import last_token_index, ppo_advantages, token_rewards, value_loss
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.ppo import PPOTrainer

TOY_REWARD = [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]




def _cfg(world: dict[str, str], out: str, **kw) -> PPOConfig:
    base = {"model": world["model"], "train_data": world["data"], "out_dir": out,
            "rewards": TOY_REWARD, "prompts_per_step": 32, "group_size": 2,
            "max_new_tokens": 8, "lr": 1e-2, "critic_lr": 1e-2, "max_steps": 12,
            "progress": False, "seed": 0, "threads": 1, "kl_coef": 0.01, "ppo_epochs": 2,
            "mini_batches": 2, "micro_batch_size": 64, "report_to": []}
    return build_config(PPOConfig, overrides={**base, **kw})


# ---- pure pieces ---------------------------------------------------------------------------
def test_token_rewards_put_the_score_on_the_last_real_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]], dtype=torch.bool)  # row 1 has a hole
    kl = torch.tensor([[0.5, -1.0, 2.0, 99.0], [1.0, 99.0, 3.0, 99.0]])
    rewards = token_rewards(torch.tensor([1.0, -2.0]), mask, kl, beta=0.1)
    # row 0: -0.1*[0.5, -1, 2] + [0, 0, 1] = [-0.05, 0.1, 0.8]; row 1: [-0.1, 0, -0.3 - 2]
    expected = torch.tensor([[-0.05, 0.1, 0.8, 0.0], [-0.1, 0.0, -2.3, 0.0]])
    assert torch.allclose(rewards, expected)
    assert torch.equal(last_token_index(mask), torch.tensor([2, 2]))
    assert torch.equal(token_rewards(torch.tensor([1.0, 1.0]), mask)[:, :2],
                       torch.tensor([[0.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="at least one real token"):
        last_token_index(torch.tensor([[True], [False]]))


def test_gae_with_score_only_at_the_end():
    """gamma=1, lam=1 (Monte Carlo), no KL: every advantage is R - V[t]."""
    mask = torch.tensor([[True, True, True]])
    rewards = token_rewards(torch.tensor([1.0]), mask)
    values = torch.tensor([[0.2, 0.5, 0.9]])
    adv, ret = ppo_advantages(rewards, values, mask, 1.0, 1.0, whiten=False)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.5, 0.1]]))
    assert torch.allclose(ret, torch.ones(1, 3))


def test_values_at_masked_positions_never_matter():
    """Garbage values on padding/holes change neither advantages, returns nor the value loss."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 9, generator=g) > 0.3
    mask[:, 0] = True
    rewards = token_rewards(torch.randn(6, generator=g), mask, torch.randn(6, 9, generator=g),
                            0.1)
    values = torch.randn(6, 9, generator=g)
    garbage = torch.where(mask, values, torch.full_like(values, 1e6))
    for whiten in (False, True):
        a1, r1 = ppo_advantages(rewards, values, mask, 0.9, 0.8, whiten)
        a2, r2 = ppo_advantages(rewards, garbage, mask, 0.9, 0.8, whiten)
        assert torch.allclose(a1, a2) and torch.allclose(r1, r2)
    new = values + 0.3 * torch.randn(6, 9, generator=g)
    new_garbage = torch.where(mask, new, torch.full_like(new, -1e6)).requires_grad_(True)
    l1, _ = value_loss(new, values, r1, mask, 0.2)
    l2, _ = value_loss(new_garbage, garbage, r1, mask, 0.2)
    assert torch.allclose(l1, l2)
    l2.backward()
    assert torch.equal(new_garbage.grad[~mask], torch.zeros(int((~mask).sum())))


# ---- trainer-level -------------------------------------------------------------------------
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_first_update_has_ratio_one_and_zero_approx_kl(toy_world, tmp_path, ckpt):
    """Also with activation checkpointing (the group's shared prompt runs through the
    checkpointed layers in the learner's pass, not in the no-grad old log-probs)."""
    trainer = PPOTrainer(_cfg(toy_world, str(tmp_path), gradient_checkpointing=ckpt))
    rollout, scores, metrics = trainer.rollout_and_score()
    batch = trainer.prepare(rollout, scores, metrics)
    trainer.model.train()  # as in `step`: checkpointing acts in training mode only
    n_tok = float(batch.response_mask.sum())
    totals = {"tokens": n_tok, "seqs": float(batch.num_sequences), "policy_tokens": n_tok,
              "policy_seqs": float(batch.num_sequences)}
    _, m = trainer.micro_loss(batch, totals, train_policy=True)
    m = {k: float(v) for k, v in m.items()}
    assert abs(m["policy/ratio_max"] - 1.0) < 1e-5 and abs(m["policy/ratio_min"] - 1.0) < 1e-5
    assert abs(m["policy/approx_kl"]) < 1e-7 and m["policy/clipfrac"] == 0.0
    # the critic starts as a zero head: V = 0, so the first value loss is 0.5 * mean(R_t^2)
    assert metrics["critic/value_mean"] == 0.0
    expected = 0.5 * float((batch.returns[batch.response_mask] ** 2).mean())
    assert m["loss/value"] == pytest.approx(expected, rel=1e-5)


def test_early_stop_with_tiny_target_kl(toy_world, tmp_path):
    cfg = _cfg(toy_world, str(tmp_path), target_kl=1e-9, ppo_epochs=4, mini_batches=4)
    trainer = PPOTrainer(cfg)
    out = trainer.step(1)
    assert out["ppo/early_stopped"] == 1.0 and out["ppo/updates"] < 16
    assert out["policy/approx_kl_at_stop"] > 1e-9
    free = PPOTrainer(_cfg(toy_world, str(tmp_path / "free"), ppo_epochs=4, mini_batches=4))
    out = free.step(1)
    assert out["ppo/early_stopped"] == 0.0 and out["ppo/updates"] == 16


def test_adaptive_kl_moves_beta_toward_the_target(toy_world, tmp_path):
    """The policy's KL to the reference is tiny early on: beta must fall toward a large target
    and rise toward a target far below the measured KL."""
    low = PPOTrainer(_cfg(toy_world, str(tmp_path / "a"), adaptive_kl=True, kl_coef=0.1,
                          kl_target=50.0, kl_horizon=100.0, max_steps=3))
    for step in range(1, 4):
        low.step(step)
    assert low.kl_ctl.value < 0.1
    high = PPOTrainer(_cfg(toy_world, str(tmp_path / "b"), adaptive_kl=True, kl_coef=0.1,
                           kl_target=1e-6, kl_horizon=100.0, max_steps=3))
    for step in range(1, 3):
        high.step(step)  # step 1 has KL 0 (policy == reference): beta falls once
    metrics = high.step(3)
    assert metrics["kl/mean"] > 1e-6 and high.kl_ctl.value > metrics["kl/coef"]


def test_critic_warmup_freezes_the_policy(toy_world, tmp_path):
    trainer = PPOTrainer(_cfg(toy_world, str(tmp_path), critic_warmup_steps=2))
    policy = [p.detach().clone() for p in trainer.model.parameters()]
    critic = [p.detach().clone() for p in trainer.critic.parameters()]
    out = trainer.step(1)
    assert "loss/policy" not in out and out["loss/value"] > 0
    assert all(torch.equal(a, b) for a, b in zip(policy, trainer.model.parameters(),
                                                  strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(critic, trainer.critic.parameters(),
                                                      strict=True))
    trainer.step(3)
    assert any(not torch.equal(a, b) for a, b in zip(policy, trainer.model.parameters(),
                                                      strict=True))


def _reward_curve(out: str) -> list[float]:
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def test_ppo_learns_toy_reward(toy_world, tmp_path):
    summary = PPOTrainer(_cfg(toy_world, str(tmp_path))).train()
    curve = _reward_curve(str(tmp_path))
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    # a random 100-token policy writes '7' about 1% of the time; learning must beat that clearly
    assert last > first + 0.1 and last > 4 * first, f"reward did not rise: {curve}"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("policy/approx_kl", "policy/clipfrac", "critic/explained_variance",
                "critic/value_mean", "loss/value", "loss/policy", "policy/entropy",
                "reward/kl_penalty", "kl/coef", "response/length_mean"):
        assert key in rows[1], key
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert (tmp_path / "critic" / "value_head.safetensors").is_file()
    assert summary["steps"] == 12 and summary["seconds"] > 0


def test_lora_shares_one_base_and_learns(toy_world, tmp_path):
    """Two adapters, one frozen base: no reference copy and no second body; the reference is
    the adapters-off base; only adapters and the value head train."""
    cfg = _cfg(toy_world, str(tmp_path), lora_r=8, lora_alpha=32, lr=3e-2, critic_lr=3e-2,
               lora_target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], max_steps=3)
    trainer = PPOTrainer(cfg)
    assert trainer.ref.model is None and trainer.critic.peft_model is trainer.model
    assert all("lora_" in n and "critic" not in n for n, p in trainer.model.named_parameters()
               if any(p is q for q in trainer.groups[0].params))
    n_opt = sum(len(g["params"]) for g in trainer.opt.param_groups)
    assert n_opt == len(trainer.groups[0].params)
    ids = torch.tensor([[5, 6, 7, 8]])
    trainer.step(1)
    trainer.step(2)
    with torch.no_grad():
        policy_logits = trainer.model(input_ids=ids).logits
    trainer.save(str(tmp_path / "final"))  # merges the ACTIVE (policy) adapter only
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert torch.allclose(reloaded(input_ids=ids).logits, policy_logits, atol=1e-5)
    assert (tmp_path / "critic" / "value_head.safetensors").is_file()


@pytest.mark.parametrize("kind", ["reward_model", "causal_lm"])
def test_critic_from_a_model_dir(toy_world, tmp_path, kind):
    """critic_model: a 1-label classifier (its score layer is the value head, so the first
    values are its scores, not 0) or another causal LM (its body, a zero head)."""
    tok = build_char_tokenizer()
    if kind == "reward_model":
        config = build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                                  intermediate_size=64, max_position_embeddings=64).config
        config.num_labels = 1
        other = LlamaForSequenceClassification(config)
    else:
        other = build_tiny_llama(tok, hidden_size=48, num_layers=2, num_heads=2,
                                 intermediate_size=64, max_position_embeddings=64, seed=5)
    save_checkpoint(other, tok, tmp_path / "critic_src")
    trainer = PPOTrainer(_cfg(toy_world, str(tmp_path / "out"), kl_coef=0.0,
                              critic_model=str(tmp_path / "critic_src")))
    assert trainer.ref.model is None  # beta 0: no reference model at all
    assert trainer.critic.head.in_features == other.config.hidden_size
    rollout, scores, metrics = trainer.rollout_and_score()
    trainer.prepare(rollout, scores, metrics)
    assert (metrics["critic/value_mean"] != 0.0) == (kind == "reward_model")
    assert trainer.step(1)["ppo/updates"] == 4


def test_bad_config_is_a_clear_error(toy_world, tmp_path):
    with pytest.raises(ConfigError, match="target_kl"):
        _cfg(toy_world, str(tmp_path), target_kl=0.0)
    with pytest.raises(ConfigError, match="adaptive_kl"):
        _cfg(toy_world, str(tmp_path), adaptive_kl=True, kl_coef=0.0)
    with pytest.raises(ConfigError, match="critic_model"):
        _cfg(toy_world, str(tmp_path), lora_r=4, critic_model="x")
    with pytest.raises(ConfigError, match="mini_batches"):
        _cfg(toy_world, str(tmp_path), mini_batches=1000)
