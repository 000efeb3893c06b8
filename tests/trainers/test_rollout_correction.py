"""The rollout correction in the trainers: a sampler whose log-probs are off by a known amount
runs GRPO and PPO end to end, and the `rollout/*` metrics and the weights see it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.config import GRPOConfig, PPOConfig, build_config
from posttrain.rollout.sampler import SAMPLERS
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.ppo import PPOTrainer
from tests.rollout.doubles import shifted_hf

TOY_REWARD = [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]


def _cfg(world: dict[str, str], out: str, **kw) -> GRPOConfig:
    base = {"model": world["model"], "train_data": world["data"], "out_dir": out,
            "rewards": TOY_REWARD, "group_size": 4, "prompts_per_step": 4,
            "max_new_tokens": 8, "lr": 1e-2, "max_steps": 2, "progress": False,
            "seed": 0, "threads": 1, "eval_size": 0}
    return build_config(GRPOConfig, overrides={**base, **kw})


@pytest.fixture
def shifted_sampler(monkeypatch):
    """Set `shifted_sampler["value"]`: the training sampler then reports log q = log pi + value on
    every counted token (a biased sampler, registered as `rollout_engine: hf`)."""
    shift = {"value": 0.0}
    real = SAMPLERS["hf"]

    def factory(*args, **kwargs):
        return shifted_hf(shift["value"], real=real)(*args, **kwargs)

    monkeypatch.setitem(SAMPLERS, "hf", factory)
    return shift


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss/policy" in r]


def test_no_gap_in_fp32(toy_world, tmp_path, shifted_sampler):
    """The hf sampler in fp32 samples from the learner's own distribution: no gap."""
    GRPOTrainer(_cfg(toy_world, str(tmp_path))).train()
    for row in _rows(tmp_path):
        assert row["rollout/logprob_abs_diff"] < 1e-5 and row["rollout/k3"] < 1e-9
        assert abs(row["rollout/is_mean"] - 1.0) < 1e-5 and row["rollout/ess"] > 1 - 1e-6


def test_a_shifted_sampler_is_seen_and_corrected(toy_world, tmp_path, shifted_sampler):
    """log q = log pi + 0.3: log r = -0.3 on every token, so every token's weight is e^-0.3, and
    k3 of KL(q || pi) with d = log q - log pi = 0.3 is e^-d + d - 1 = 0.7408182 - 0.7."""
    shifted_sampler["value"] = 0.3
    GRPOTrainer(_cfg(toy_world, str(tmp_path), rollout_is="token_truncate")).train()
    rows = _rows(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/logprob_abs_diff"] == pytest.approx(0.3, abs=1e-5)
        assert row["rollout/is_mean"] == pytest.approx(math.exp(-0.3), rel=1e-5)
        assert row["rollout/k3"] == pytest.approx(math.exp(-0.3) - 0.7, rel=1e-4)
        assert row["rollout/is_clipfrac"] == 0.0


def test_weights_reach_the_loss(toy_world, tmp_path, shifted_sampler):
    """A sampler shift of -ln 2 per token makes every token's weight 2 (below the cap 3): the
    first step's gradient is exactly twice the uncorrected one (same samples, same seeds; the
    on-policy loss itself is ~0 since group advantages sum to 0)."""
    shifted_sampler["value"] = -math.log(2.0)
    kw = {"max_steps": 1, "max_grad_norm": 0.0}
    GRPOTrainer(_cfg(toy_world, str(tmp_path / "none"), rollout_is="none", **kw)).train()
    GRPOTrainer(_cfg(toy_world, str(tmp_path / "tok"), rollout_is="token_truncate",
                     **kw)).train()
    plain, weighted = _rows(tmp_path / "none")[0], _rows(tmp_path / "tok")[0]
    assert plain["train/grad_norm"] > 0.0
    assert weighted["train/grad_norm"] == pytest.approx(2.0 * plain["train/grad_norm"], rel=1e-4)
    assert weighted["rollout/is_mean"] == pytest.approx(2.0, rel=1e-5)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_truncated_weights_from_the_update_equal_the_extra_pass(toy_world, tmp_path,
                                                                 shifted_sampler, monkeypatch,
                                                                 mode):
    """One update a step: the truncated weights come from the update's own forward (no pass of
    their own); the same run with the extra pass gives the same metrics and weights."""
    shifted_sampler["value"] = -0.4
    kw = {"rollout_is": mode, "rollout_is_cap": 1.3}  # some tokens above the cap: truncated
    passes: list[int] = []
    logprobs = GRPOTrainer.policy_logprobs
    monkeypatch.setattr(GRPOTrainer, "policy_logprobs",
                        lambda self, *a: passes.append(1) or logprobs(self, *a))
    GRPOTrainer(_cfg(toy_world, str(tmp_path / "own"), **kw)).train()
    assert passes == []
    monkeypatch.setattr(GRPOTrainer, "defer_truncated_weights", False)
    GRPOTrainer(_cfg(toy_world, str(tmp_path / "extra"), **kw)).train()
    assert len(passes) == 2  # one extra pass a step
    a, b = _rows(tmp_path / "own"), _rows(tmp_path / "extra")
    assert a[0]["rollout/is_clipfrac"] > 0
    for ra, rb in zip(a, b, strict=True):
        for k in ra:
            if k.startswith(("loss/", "rollout/", "train/grad_norm", "policy/")):
                assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), k


def test_every_sequence_rejected_is_loud(toy_world, tmp_path, shifted_sampler):
    """sequence_mask with every sequence's ratio far above the cap leaves nothing to train on:
    the step is skipped and says so, nothing turns into nan."""
    shifted_sampler["value"] = -2.0  # R_i = e^(2 * length) > 3 for every sequence
    GRPOTrainer(_cfg(toy_world, str(tmp_path), max_steps=1, rollout_is="sequence_mask")).train()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1 and "reward/mean" in r][0]
    assert step["train/skipped_empty_batch"] == 1.0
    assert all(not (isinstance(v, float) and math.isnan(v)) for k, v in step.items()
               if not k.startswith("reward/"))


def _ppo_cfg(world: dict[str, str], out: str, **kw) -> PPOConfig:
    base = {"model": world["model"], "train_data": world["data"], "out_dir": out,
            "rewards": TOY_REWARD, "prompts_per_step": 8, "group_size": 2,
            "max_new_tokens": 8, "lr": 1e-2, "critic_lr": 1e-2, "max_steps": 2,
            "progress": False, "seed": 0, "threads": 1, "ppo_epochs": 1, "eval_size": 0,
            "report_to": []}
    return build_config(PPOConfig, overrides={**base, **kw})


def test_ppo_sees_and_corrects_the_gap(toy_world, tmp_path, shifted_sampler):
    """PPO's pi_old is always the learner's forward; a sampler shift of -ln 2 doubles every
    token's weight and so the first policy gradient (the critic's is unchanged)."""
    shifted_sampler["value"] = -math.log(2.0)
    kw = {"max_steps": 1, "max_grad_norm": 0.0}
    PPOTrainer(_ppo_cfg(toy_world, str(tmp_path / "none"), rollout_is="none", **kw)).train()
    PPOTrainer(_ppo_cfg(toy_world, str(tmp_path / "tok"), rollout_is="token_truncate",
                        **kw)).train()
    plain, weighted = _rows(tmp_path / "none")[0], _rows(tmp_path / "tok")[0]
    assert plain["rollout/logprob_abs_diff"] == pytest.approx(math.log(2.0), abs=1e-5)
    assert weighted["rollout/is_mean"] == pytest.approx(2.0, rel=1e-5)
    assert weighted["train/grad_norm"] == pytest.approx(2.0 * plain["train/grad_norm"], rel=1e-4)
    assert weighted["critic/grad_norm"] == pytest.approx(plain["critic/grad_norm"], rel=1e-5)


def test_ppo_every_sequence_rejected_trains_only_the_critic(toy_world, tmp_path,
                                                            shifted_sampler):
    shifted_sampler["value"] = -2.0
    PPOTrainer(_ppo_cfg(toy_world, str(tmp_path), rollout_is="sequence_mask")).train()
    assert _rows(tmp_path) == []  # no step computed a policy loss
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/value" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss/value"]) for r in steps)
    assert all(r["rollout/is_clipfrac"] == 1.0 for r in steps)


@pytest.mark.parametrize("kw", [
    {"kl_coef": 0.04},  # the reference pass
    {"kl_coef": 0.04, "rollout_is": "token_truncate"},  # + pi_old for the correction
    {"kl_coef": 0.0, "num_iterations": 2, "old_logprobs": "recompute"},  # pi_old, no reference
])
def test_a_rank_with_no_groups_joins_the_same_gathers(toy_world, tmp_path, kw):
    """Under FSDP2 every no-grad pass of step 3 all-gathers: a rank whose groups were all filtered
    out must enter the same gathers, in the same order, as a rank with samples (else the others
    wait for it forever). Recorded on one process by standing in for `Dist.gathered`."""
    import contextlib

    trainer = GRPOTrainer(_cfg(toy_world, str(tmp_path), max_steps=1, **kw))
    calls: list[str] = []

    @contextlib.contextmanager
    def gathered(model):
        calls.append("reference" if model is not trainer.learner() else "policy")
        yield model

    trainer.dist.fsdp = True  # only the gathers' bookkeeping: no module here is sharded
    trainer.dist.gathered = gathered
    trainer._step = 1
    rollout, metrics = trainer.rollout_step()
    calls.clear()  # generation's own gather
    trainer.compute_advantages(rollout, metrics)
    with_samples, calls[:] = list(calls), []
    trainer.compute_advantages(rollout.select([]), {})
    assert with_samples and calls == with_samples
