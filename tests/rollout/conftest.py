"""Fixtures shared by the vLLM engine tests."""

import pytest

from posttrain.config import engine as engine_checks
from posttrain.rollout import vllm_engine
from tests.rollout import fake_vllm


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.setattr(engine_checks, "vllm_available", lambda: True)
    monkeypatch.setattr(engine_checks, "_cuda", lambda: True)
    monkeypatch.setattr(vllm_engine, "_KEPT", [], raising=False)
    return fake_vllm.install(monkeypatch)
