"""The colocated vLLM sampler against a stand-in built to vLLM 0.33's surface
(tests/rollout/fake_vllm.py): built from the config, weights pushed under names the checkpoint
has, sleep / wake as vLLM does them, the trainer's RNG and process group left alone, and a GRPO
run end to end. No `Tensor.cuda` patching: on the CPU the sampler's device is the CPU."""

from __future__ import annotations

import gc
import json
import random
import weakref

import numpy as np
import pytest
import torch

from posttrain.config import GRPOConfig, build_config
from posttrain.models.loading import save_checkpoint
from posttrain.rollout import SamplingParams, generate, vllm_sampler
from posttrain.rollout.weights import iter_weights
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout import fake_vllm

PROMPTS = ["ab", "cde", "f"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_world")
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, max_position_embeddings=64, seed=0)
    save_checkpoint(model, tok, root / "model")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": c, "answer": "7"}) + "\n" for c in "abcdef"))
    return {"model": model, "tok": tok, "dir": str(root / "model"), "data": str(data)}


def _engine(world, **kw) -> vllm_sampler.VLLMColocateSampler:
    cfg = GRPOConfig(model=world["dir"], rollout_engine="vllm_colocate", **kw)
    return vllm_sampler.VLLMColocateSampler.from_config(cfg, world["tok"])


def test_weights_sleep_and_sampling_follow_vllm(world, vllm):
    model, tok = world["model"], world["tok"]
    sampler = _engine(world)
    llm = sampler.llm
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.sleep_mode
    assert sampler.device == torch.device("cpu")
    sampler.update_weights(model, 3)
    sampler.update_weights(model, 3)  # unchanged version: nothing pushed
    assert llm.log == [("reset_prefix_cache",)]
    for name, t in (p for b in iter_weights(model) for p in b):  # every name known, loaded
        assert torch.equal(llm.model.tensors[name], t.to(llm.model.tensors[name].dtype)), name
    sampler.sleep()
    sampler.update_weights(model, 4)  # wakes the weights only: the scheduler stays paused
    assert llm.log[1:] == [("sleep", 1), ("wake_up", ("weights",)), ("reset_prefix_cache",)]
    assert llm.paused and llm.sleeping_tags == {"kv_cache"}
    seeds = [10, 11, 12, 13, 14, 15]
    r = sampler.generate(PROMPTS, group_size=2, seeds=seeds, batch_size=4,
                        params=SamplingParams(max_new_tokens=4, temperature=0.7))
    assert llm.log[4:] == [("wake_up", ("kv_cache",)), ("generate", 4), ("generate", 2)]
    assert not llm.paused
    for i, s in enumerate(seeds):  # each sequence from its own seed, cut at the first stop id
        sp = fake_vllm.SamplingParams(seed=s, max_tokens=4, stop_token_ids=[tok.eos_token_id])
        want = fake_vllm.sample([], sp, llm.model.vocab).token_ids
        assert r.completion_ids[i, :len(want)].tolist() == want
        assert r.logprobs[i][r.response_mask[i]].eq(fake_vllm.LOGPROB).all()
    assert torch.equal(r.prompt_ids, generate(model, tok, PROMPTS, group_size=2,
                                              params=SamplingParams(max_new_tokens=1)).prompt_ids)
    with pytest.raises(ValueError, match="without truncation"):
        sampler.generate(PROMPTS, params=SamplingParams(top_k=3))


def test_the_fake_holds_vllms_line(world, vllm):
    """What the fake refuses, as vLLM 0.33 does: unknown weight names, unknown LLM keywords,
    a temperature above 2, sampling while paused; wake_up(None) wakes everything."""
    sampler = _engine(world)
    with pytest.raises(ValueError, match="no module or parameter named 'lm_head.bias'"):
        sampler._load([("lm_head.bias", torch.zeros(3))])
    with pytest.raises(TypeError, match="unexpected keyword"):
        vllm.LLM(world["dir"], enable_prefix_caching_typo=True)
    with pytest.raises(ValueError, match="temperature"):
        vllm.SamplingParams(temperature=2.5)
    sampler.llm.sleep(level=1)
    with pytest.raises(RuntimeError, match="paused"):
        sampler.llm.generate([{"prompt_token_ids": [1]}], vllm.SamplingParams())
    assert sampler.llm.wake_up(None) is True and not sampler.llm.paused


def test_wake_empties_the_cuda_cache_first(world, vllm, monkeypatch):
    sampler = _engine(world)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: sampler.llm.log.append(("empty",)))
    sampler.sleep()
    sampler.wake()
    assert sampler.llm.log == [("sleep", 1), ("empty",), ("wake_up", ("weights", "kv_cache"))]


def test_building_the_engine_keeps_the_trainers_rng(world, vllm):
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    want = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    _engine(world, seed=0)  # vLLM reseeds python, numpy and torch with its own seed
    assert (random.random(), np.random.rand()) == want[:2] and torch.equal(torch.rand(1), want[2])


def test_close_keeps_the_trainers_process_group(world, vllm, tmp_path):
    """vLLM's finalizer destroys the default process group; a group the trainer made before the
    sampler must outlive `close` (the final barriers still use it); without one the sampler is
    released for good."""
    alone = _engine(world)
    ref = weakref.ref(alone.llm)
    alone.close()
    gc.collect()
    assert ref() is None  # released: nothing of the trainer's to protect
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                                         world_size=1)
    try:
        sampler = _engine(world)
        llm = sampler.llm
        sampler.close()
        del llm
        gc.collect()
        assert torch.distributed.is_initialized()  # the trainer's group is still there
        kept = vllm_sampler._KEPT[-1]
        assert kept.paused and kept.sleeping_tags == {"weights", "kv_cache"}  # asleep
        torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_grpo_trains_on_the_colocated_engine(world, vllm, tmp_path, monkeypatch):
    """GRPO end to end with `rollout_engine: vllm_colocate` on the fake: every step wakes the
    weights, pushes them, wakes the rest and samples from vLLM (its log-probs are what the
    rollouts carry) and sleeps while training."""
    from posttrain.trainers.grpo import GRPOTrainer

    built: list = []
    real = vllm.LLM
    monkeypatch.setattr(vllm, "LLM", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
    cfg = build_config(GRPOConfig, overrides={
        "model": world["dir"], "train_data": world["data"], "out_dir": str(tmp_path),
        "rewards": [{"name": "tests.trainers.toy_rewards:sevens", "weight": 1.0}],
        "rollout_engine": "vllm_colocate", "group_size": 2, "prompts_per_step": 2,
        "max_new_tokens": 4, "max_steps": 2, "progress": False, "report_to": [], "threads": 1,
        "eval_size": 0, "temperature": 0.7})
    trainer = GRPOTrainer(cfg)
    seen = []
    real_step = trainer.rollout_step

    def spy():
        out = real_step()
        seen.append(out[0])
        return out

    monkeypatch.setattr(trainer, "rollout_step", spy)
    trainer.train()
    assert len(built) == 1
    log = [e[0] for e in built[0].log]
    # pushes: before the first evaluation (version 0, also step 1's), step 2, the final one
    assert log.count("generate") == 2 and log.count("reset_prefix_cache") == 3
    assert log.count("sleep") == 2  # asleep while each step trained
    for r in seen:
        assert r.logprobs[r.response_mask].eq(fake_vllm.LOGPROB).all()  # vLLM's samples
