"""Fixtures shared by the vLLM sampler tests."""

import pytest

from posttrain.config import sampler as sampler_checks
from posttrain.engine import trainer
from posttrain.rollout import vllm_sampler
from tests.rollout import fake_vllm


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.setattr(sampler_checks, "vllm_available", lambda: True)
    monkeypatch.setattr(sampler_checks, "_cuda", lambda: True)
    monkeypatch.setattr(sampler_checks, "vllm_cpu_build", lambda: False)  # plays a CUDA vLLM
    monkeypatch.setattr(vllm_sampler, "_KEPT", [], raising=False)
    # the stand-in samples fixed log-probs, so it cannot score a probe like the learner: the
    # push check runs against the real vLLM only (`pytest -m vllm`, test_real_vllm.py)
    monkeypatch.setattr(trainer, "probe_ids", lambda *a, **k: [0, 1])
    monkeypatch.setattr(trainer, "check_push", lambda *a, **k: 0.0)
    return fake_vllm.install(monkeypatch)

