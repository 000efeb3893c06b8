"""Every trainer that samples takes the sampler's rollout onto its own device, in one place
(`posttrain.rollout.sampler.on_device`, called by `PromptRLTrainer.sample_prompts`): vLLM builds
its rollouts on the CPU while the policy is on the GPU. On a CPU machine the only other device is
`meta`: a rollout there (no data, cannot be moved) must be refused in one line naming the sampler
before any trainer math touches it."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import GRPOConfig, PPOConfig, build_config
from posttrain.rollout.record import Rollout
from posttrain.rollout.sampler import SAMPLERS, on_device
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.ppo import PPOTrainer
from tests.rollout.doubles import Wrapped

TOY_REWARD = [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}]
SAMPLING_TRAINERS = {"grpo": (GRPOConfig, GRPOTrainer), "ppo": (PPOConfig, PPOTrainer)}


def _elsewhere(monkeypatch, device: str) -> None:
    """Register an `hf` sampler whose training rollouts come back on `device`."""
    real = SAMPLERS["hf"]

    def factory(cfg, tok, *, role="eval", **kw):
        inner = real(cfg, tok, role=role, **kw)
        return Wrapped(inner, lambda r: r.to(device)) if role == "train" else inner

    monkeypatch.setitem(SAMPLERS, "hf", factory)


@pytest.mark.parametrize("command", sorted(SAMPLING_TRAINERS))
def test_a_rollout_on_another_device_is_refused(command, toy_world, tmp_path, monkeypatch):
    config, trainer = SAMPLING_TRAINERS[command]
    _elsewhere(monkeypatch, "meta")
    cfg = build_config(config, overrides={
        "model": toy_world["model"], "train_data": toy_world["data"], "out_dir": str(tmp_path),
        "rewards": TOY_REWARD, "group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4,
        "max_steps": 1, "progress": False, "threads": 1, "eval_size": 0, "report_to": []})
    with pytest.raises(ValueError) as err:
        trainer(cfg).train()
    assert str(err.value) == ("config key 'rollout_engine'=hf: the sampler returned its rollout "
                              "on ['meta'], tensors without data; the trainer needs them on cpu")


def test_on_device_moves_every_tensor_and_keeps_the_rest():
    r = Rollout(prompt_ids=torch.ones(2, 3, dtype=torch.long),
                prompt_mask=torch.ones(2, 3, dtype=torch.bool),
                completion_ids=torch.ones(2, 4, dtype=torch.long),
                response_mask=torch.ones(2, 4, dtype=torch.bool), logprobs=torch.zeros(2, 4),
                truncated=torch.zeros(2, dtype=torch.bool), group_size=2,
                completions=["a", "b"], rows=[{}, {}], scores=torch.zeros(2))
    assert on_device(r, torch.device("cpu"), "hf") is r  # already there: no copy
    moved = on_device(r, torch.device("meta"), "vllm_colocate")  # any other device: moved
    assert moved.devices() == {torch.device("meta")}
    assert moved.completions == r.completions and moved.group_size == 2
    assert moved.advantages is None and r.devices() == {torch.device("cpu")}
