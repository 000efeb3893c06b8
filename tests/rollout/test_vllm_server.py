"""The server sampler against a stand-in for `vllm serve` 0.33 on 127.0.0.1
(tests/rollout/fake_vllm.py `FakeServer`): requests carry every sampling field the server would
otherwise take from generation_config.json, the log-prob mode is checked at start, and under
torchrun no rank samples before rank 0 has pushed the weights. The NCCL transfer itself needs
GPUs on both sides (scripts/gpu_smoke.sh)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from posttrain.config import GRPOConfig
from posttrain.config import sampler as sampler_checks
from posttrain.models.loading import save_checkpoint
from posttrain.rollout import SamplingParams
from posttrain.rollout.vllm_server import VLLMServerSampler
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout import fake_vllm

# Qwen2.5-Instruct's generation_config.json sets some of these; any of them changes the samples
CHECKPOINT_DEFAULTS = {"top_k": 20, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.05,
                       "presence_penalty": 0.5, "frequency_penalty": 0.5}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_server")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, max_position_embeddings=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    return {"model": model, "tok": tok, "dir": str(root / "model")}


def _engine(server: fake_vllm.FakeServer, tok, **kw) -> VLLMServerSampler:
    return VLLMServerSampler(server.url, tok, [tok.eos_token_id], group_host="127.0.0.1",
                            group_port=51216, timeout=10, **kw)


def test_requests_are_neutral_whatever_the_checkpoint_says(world):
    tok = world["tok"]
    with fake_vllm.FakeServer(world["dir"], generation_config=CHECKPOINT_DEFAULTS) as server:
        sampler = _engine(server, tok)
        seeds = [3, 4, 5, 6]
        r = sampler.generate(["ab", "c"], group_size=2, seeds=seeds,
                            params=SamplingParams(max_new_tokens=5, temperature=0.7))
    assert len(server.resolved) == 4
    assert sorted(sp.seed for sp in server.resolved) == seeds
    for sp in server.resolved:
        neutral = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0}
        assert {k: getattr(sp, k) for k in neutral} == neutral
        assert sp.temperature == 0.7 and sp.logprobs == 0 and sp.n == 1
    for i, seed in enumerate(seeds):  # sequence i is the server's sample of its own seed
        sp = fake_vllm.SamplingParams(seed=seed, max_tokens=5, stop_token_ids=[tok.eos_token_id])
        want = fake_vllm.sample([], sp, server.vocab).token_ids
        assert r.completion_ids[i, :len(want)].tolist() == want
        assert r.logprobs[i][r.response_mask[i]].eq(fake_vllm.LOGPROB).all()


@pytest.mark.parametrize("mode, dev, needle", [
    ("raw_logprobs", True, "returns logprobs_mode=raw_logprobs, not the log-probs after "
                           "temperature"),
    ("processed_logprobs", False, "cannot read the server's /server_info"),
])
def test_a_server_with_other_logprobs_is_refused_at_start(world, mode, dev, needle):
    with (fake_vllm.FakeServer(world["dir"], logprobs_mode=mode, dev_mode=dev) as server,
          pytest.raises(RuntimeError) as err):
        _engine(server, world["tok"])
    msg = str(err.value)
    assert msg.startswith("config key 'rollout_engine'=vllm_server: ") and needle in msg
    assert "\n" not in msg
    assert msg.endswith(f"restart it with: posttrain vllm-serve {world['dir']}")


@pytest.mark.parametrize("amx", [True, False])
def test_a_bf16_cpu_server_is_refused_on_a_cpu_with_amx(world, monkeypatch, amx):
    """vLLM's CPU build kills its worker at the first bf16 request on an Intel CPU with AMX
    (docs/rollout.md): refused at start in one line naming the fix, on that CPU kind only."""
    from posttrain.rollout import vllm_server

    monkeypatch.setattr(vllm_server, "amx_tiles", lambda: amx)
    with fake_vllm.FakeServer(world["dir"], dtype="torch.bfloat16") as server:
        if not amx:
            assert _engine(server, world["tok"])._served == world["dir"]
            return
        with pytest.raises(RuntimeError) as err:
            _engine(server, world["tok"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config key 'rollout_engine'=vllm_server: ")
    assert "serves bfloat16 on vLLM's CPU build" in msg and msg.endswith("--dtype float32")


def test_no_rank_samples_before_the_push_ends(world, monkeypatch):
    """Two torchrun ranks (threads here, a barrier between them): rank 1's `update_weights`
    returns only after rank 0 has sent every bucket and reset the server's prefix cache."""
    events: list[str] = []
    barrier = threading.Barrier(2, timeout=10)
    with fake_vllm.FakeServer(world["dir"]) as server:
        main = _engine(server, world["tok"])
        other = _engine(server, world["tok"], is_main=False)
        for sampler in (main, other):
            sampler.barrier = barrier.wait

        def send(bucket):
            time.sleep(0.1)  # NCCL broadcasts take a while
            events.append("sent")

        main.via_file = False  # the NCCL path
        monkeypatch.setattr(main, "_init_group", lambda: setattr(main, "_comm", object()))
        monkeypatch.setattr(main, "_send", send)
        real_post = main._post
        monkeypatch.setattr(main, "_post", lambda path, body=None: (
            events.append(path), real_post(path, body))[1])
        threads = [threading.Thread(target=e.update_weights, args=(world["model"], 1))
                   for e in (main, other)]
        threads[1].start()
        threads[1].join(timeout=0.05)  # rank 1 runs ahead
        threads[0].start()
        threads[1].join(timeout=10)
        events.append("rank 1 returned")
        threads[0].join(timeout=10)
    assert events[-2:] == ["/reset_prefix_cache", "rank 1 returned"], events
    assert events.count("sent") >= 1 and ("/reset_prefix_cache", {}) in server.calls


def test_from_config_waits_on_the_trainers_barrier(world, monkeypatch):
    fake_vllm.install(monkeypatch)
    monkeypatch.setattr(sampler_checks, "vllm_available", lambda: True)
    monkeypatch.setattr(sampler_checks, "_cuda", lambda: True)
    with fake_vllm.FakeServer(world["dir"]) as server:
        port = int(server.url.rsplit(":", 1)[1])
        cfg = GRPOConfig(model=world["dir"], rollout_engine="vllm_server", vllm_server_port=port)
        dist = SimpleNamespace(enabled=True, is_main=False, barrier=lambda: None)
        sampler = VLLMServerSampler.from_config(cfg, world["tok"], dist=dist)
        assert sampler.barrier is dist.barrier and not sampler.is_main
        alone = VLLMServerSampler.from_config(cfg, world["tok"])
        assert alone.barrier is None and alone.is_main
