"""The sampler protocol: the hf sampler is today's sampler, the factory and registry,
trainers and evaluation sample through the sampler, and vLLM samplers are refused in one line
where they cannot run (here: no vLLM installed, no GPU). The vLLM samplers themselves run against
a stand-in for vLLM 0.33 in test_vllm_colocate.py and test_vllm_server.py."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.config import ConfigError, GRPOConfig, SearchConfig, SFTConfig, build_config
from posttrain.config import sampler as sampler_checks
from posttrain.models.loading import save_checkpoint
from posttrain.rollout import SamplingParams, generate
from posttrain.rollout.sampler import (
    SAMPLERS,
    HFSampler,
    Sampler,
    build_sampler,
    register_sampler,
)
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout.doubles import shifted_hf

PROMPTS = ["ab", "cde", "f"]
FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "response_mask", "logprobs",
          "truncated")


@pytest.fixture(scope="module")
def model_tok():
    tok = build_char_tokenizer()
    return build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                            intermediate_size=32, seed=0), tok


def _same(a, b) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.completions == b.completions and a.rows == b.rows


@pytest.mark.parametrize("case", ["seeds", "generator", "greedy_batched", "stop_ids"])
def test_hf_engine_equals_generate(model_tok, case):
    model, tok = model_tok
    params = SamplingParams(max_new_tokens=6, temperature=0.9)
    kw: dict = {"group_size": 2, "params": params, "rows": [{"i": i} for i in range(3)]}
    if case == "seeds":
        kw["seeds"] = list(range(100, 106))
    elif case == "greedy_batched":
        kw.update(params=SamplingParams(max_new_tokens=6, greedy=True), batch_size=2)
    elif case == "stop_ids":
        kw.update(stop_ids=tok.convert_tokens_to_ids(["a", "b"]), seeds=list(range(6)))
    sampler = HFSampler(tok)
    assert isinstance(sampler, Sampler)
    sampler.update_weights(model, 0)
    if case == "generator":
        got = sampler.generate(PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
        want = generate(model, tok, PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
    else:
        got, want = sampler.generate(PROMPTS, **kw), generate(model, tok, PROMPTS, **kw)
    _same(got, want)


def test_hf_sampler_copy_follows_the_version(model_tok):
    model, tok = model_tok
    sampler = HFSampler(tok, sampler_copy=True)
    sampler.update_weights(model, 0)
    copy, autocast = sampler.sampling_model()
    assert copy is not model and autocast is False
    q = "model.layers.0.self_attn.q_proj.weight"
    copy_q = dict(copy.named_parameters())[q]
    master = dict(model.named_parameters())[q]
    old = master.detach().clone()
    try:
        with torch.no_grad():
            master.add_(1.0)
        sampler.update_weights(model, 0)  # same version: nothing happens
        assert torch.equal(copy_q, old.to(torch.bfloat16))
        sampler.update_weights(model, 1)  # new version: re-synced
        assert torch.equal(copy_q, master.detach().to(torch.bfloat16))
    finally:
        with torch.no_grad():
            master.copy_(old)
    plain = HFSampler(tok, autocast=True)
    plain.update_weights(model, 0)
    assert plain.sampling_model() == (model, True)


def test_build_engine_roles_and_registry(model_tok, monkeypatch):
    model, tok = model_tok
    cfg = GRPOConfig(autocast_bf16=True)
    train = build_sampler(cfg, tok, role="train", model=model)
    evaluation = build_sampler(cfg, tok, role="eval", model=model)
    assert train.sampling_model()[0] is not model  # the bf16 sampler copy
    assert evaluation.sampling_model() == (model, True)  # the policy under autocast, as before
    seen = []
    monkeypatch.setitem(SAMPLERS, "hf", SAMPLERS["hf"])
    previous = register_sampler("hf", lambda c, t, **kw: seen.append(kw["role"]) or
                               previous(c, t, **kw))
    build_sampler(cfg, tok, role="train", model=model)
    assert seen == ["train"]


def test_vllm_colocate_without_vllm_is_a_clear_error(model_tok, monkeypatch):
    monkeypatch.setattr(sampler_checks, "vllm_available", lambda: False)
    for cls in (GRPOConfig, SFTConfig):  # every trainer's evaluation generates
        with pytest.raises(ConfigError) as err:
            cls(rollout_engine="vllm_colocate")
        assert str(err.value) == ("config key 'rollout_engine'=vllm_colocate needs vLLM: pip "
                                  "install 'posttrain[vllm]' (or use rollout_engine: hf)")
    if sampler_checks.vllm_available():
        pytest.skip("vLLM is installed here")
    cfg = GRPOConfig()
    cfg.rollout_engine = "vllm_colocate"  # past validate(): the sampler itself says it too
    with pytest.raises(ImportError, match=r"needs vLLM: pip install 'posttrain\[vllm\]'"):
        build_sampler(cfg, model_tok[1])


@pytest.mark.parametrize("keys, needle", [
    ({"device": "cpu"}, "on a CPU (device=cpu) needs vLLM's CPU build"),
    ({"top_k": 5}, "top_k=5 / top_p=1.0: vLLM's log-probs would be renormalised"),
    ({"top_p": 0.9}, "top_p=0.9"),
    ({"vllm_gpu_memory_utilization": 1.0}, "'vllm_gpu_memory_utilization'=1.0"),
    ({"vllm_server_port": 0}, "'vllm_server_port'=0: expected a TCP port"),
    ({"temperature": 2.5}, "'temperature'=2.5: config key 'rollout_engine'=vllm_server samples "
                           "at a temperature in [0, 2.0] (vLLM refuses more)"),
])
def test_vllm_combinations_that_cannot_work(monkeypatch, keys, needle):
    monkeypatch.setattr(sampler_checks, "vllm_available", lambda: True)
    monkeypatch.setattr(sampler_checks, "_cuda", lambda: True)
    with pytest.raises(ConfigError, match="config key") as err:
        GRPOConfig(rollout_engine="vllm_server", **keys)
    assert needle in str(err.value)
    GRPOConfig(rollout_engine="vllm_server")  # a valid one
    with pytest.raises(ConfigError, match="top_p=0.5"):
        SearchConfig(eval_data="x.jsonl", rollout_engine="vllm_colocate", top_p=0.5)
    with pytest.raises(ConfigError, match="generation_batch_size"):
        GRPOConfig(generation_batch_size=-1)


def test_cli_without_vllm_is_one_line(toy_world_engine, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sampler_checks, "vllm_available", lambda: False)
    capsys.readouterr()
    code = main(["grpo", f"model={toy_world_engine['model']}",
                 f"train_data={toy_world_engine['data']}",
                 f"out_dir={tmp_path / 'run'}", "rollout_engine=vllm_colocate",
                 "report_to=none", "progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "config key 'rollout_engine'=vllm_colocate needs vLLM: pip install " \
           "'posttrain[vllm]'" in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_grpo_samples_through_a_registered_engine(toy_world_engine, tmp_path, monkeypatch):
    """A double registered as `hf` shifts the sampler's log-probs: GRPO trains with it end to
    end, every generation (with generation_batch_size) goes through it, and the rollouts it
    trains on carry the shifted log-probs."""
    from posttrain.trainers.grpo import GRPOTrainer

    built: list = []
    monkeypatch.setitem(SAMPLERS, "hf", shifted_hf(0.25, built))
    cfg = build_config(GRPOConfig, overrides={
        "model": toy_world_engine["model"], "train_data": toy_world_engine["data"],
        "eval_data": toy_world_engine["data"], "eval_size": 4,
        "out_dir": str(tmp_path), "rewards": [{"name": "tests.trainers.toy_rewards:sevens",
                                               "weight": 1.0}],
        "group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4, "max_steps": 2,
        "generation_batch_size": 2, "progress": False, "report_to": [], "threads": 1,
        "eval_max_new_tokens": 4,
        "num_iterations": 2})
    trainer = GRPOTrainer(cfg)
    captured = []
    real = trainer.rollout_step

    def spy():
        out = real()
        captured.append(out[0])
        return out

    monkeypatch.setattr(trainer, "rollout_step", spy)
    summary = trainer.train()
    assert summary["steps"] == 2 and len(built) == 1
    sampler = built[0]
    assert [c["batch_size"] for c in sampler.calls] == [2, 2]
    assert all(len(c["seeds"]) == 4 for c in sampler.calls)
    assert len(captured) == 2
    for r, raw in zip(captured, sampler.raw_logprobs, strict=True):  # the rollouts trained on
        assert torch.equal(r.logprobs, raw + 0.25 * r.response_mask.float())
        assert bool(r.response_mask.any())


@pytest.fixture(scope="module")
def toy_world_engine(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("engine_world")
    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_llama(tok, hidden_size=16, num_layers=1, num_heads=2,
                                     intermediate_size=32, max_position_embeddings=64,
                                     seed=0), tok, root / "model")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": c, "answer": "7"}) + "\n" for c in "abcdef"))
    return {"model": str(root / "model"), "data": str(data)}
