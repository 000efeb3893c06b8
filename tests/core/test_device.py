"""Config key `device` per process (one process or a torchrun rank) and the process-group
backend, as pure functions of the environment and the visible GPU count."""

from __future__ import annotations

import pytest

from posttrain.config import ConfigError, SFTConfig
from posttrain.core.device import process_device, process_group_backend


def rank(local: int, world: int = 2) -> dict[str, str]:
    return {"WORLD_SIZE": str(world), "RANK": str(local), "LOCAL_RANK": str(local)}


@pytest.mark.parametrize(("name", "cuda", "want"), [
    ("auto", 0, "cpu"), ("auto", 2, "cuda"), ("cpu", 2, "cpu"), ("cuda:1", 2, "cuda:1")])
def test_one_process_resolves_as_before(name, cuda, want):
    assert process_device(name, {}, cuda) == want
    assert process_device(name, {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, cuda) == want


@pytest.mark.parametrize("name", ["auto", "cuda", "cuda:1"])
def test_torchrun_rank_gets_the_gpu_of_its_local_rank(name):
    assert process_device(name, rank(1), cuda_count=8) == "cuda:1"


def test_torchrun_on_cpu_or_one_gpu_per_rank():
    assert process_device("auto", rank(1), cuda_count=0) == "cpu"
    assert process_device("cpu", rank(1), cuda_count=8) == "cpu"  # gloo on a GPU machine
    # CUDA_VISIBLE_DEVICES set per rank: each rank sees its own GPU as index 0
    assert process_device("cuda", rank(3, world=4), cuda_count=1) == "cuda:0"


@pytest.mark.parametrize(("name", "local"), [("cuda:0", 1), ("cuda:1", 0), ("cuda:3", 1)])
def test_torchrun_refuses_another_ranks_gpu(name, local):
    with pytest.raises(ValueError, match=rf"this rank: cuda:{local}\); use device: auto or cuda"):
        process_device(name, rank(local), cuda_count=4)


def test_torchrun_refuses_more_ranks_than_gpus():
    with pytest.raises(ValueError, match="LOCAL_RANK 2 has no GPU of its own"):
        process_device("cuda", rank(2, world=3), cuda_count=2)


def test_backend_is_gloo_for_cpu_tensors_and_nccl_only_for_cuda():
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda:1") == "cpu:gloo,cuda:nccl"


def test_preflight_refuses_a_device_under_torchrun_with_one_line(monkeypatch):
    """The check before any model loads (`posttrain.engine.preflight`; the config itself never
    probes the hardware) runs `process_device` on the real environment (a torchrun rank without
    GPUs here: `cpu` and `auto` are fine, `cuda` is refused by name)."""
    from posttrain.engine.preflight import preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    preflight(SFTConfig(device="cpu"))
    preflight(SFTConfig(device="auto"))
    cfg = SFTConfig(device="cuda")  # a config is data: made anywhere, refused where it runs
    with pytest.raises(ConfigError, match="config key 'device'='cuda'"):
        preflight(cfg)
