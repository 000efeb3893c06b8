"""Multi-turn episodes on the vLLM samplers (posttrain/rollout/episodes.py over vllm_sampler.py),
against the stand-ins built to vLLM 0.33's surface (tests/rollout/fake_vllm.py) with a scripted
model: each turn continues from token ids (never text), each request's `max_tokens` is its
episode's own remaining budget, the tool tokens are in the sequence but out of the loss and
of the importance correction."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.core.runtime import sequence_seed
from posttrain.models.loading import save_checkpoint
from posttrain.ops.importance import IS_MODES, rollout_metrics, rollout_weights
from posttrain.rollout import SamplingParams, vllm_sampler, vllm_server
from posttrain.rollout.episodes import AgentSampler
from posttrain.rollout.tools import AgentSpec
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.rollout import fake_vllm
from tests.rollout.script_lm import ids
from tests.rollout.test_episodes import add, answer, call
from tests.rollout.test_vllm_server import CHECKPOINT_DEFAULTS

TOK = build_char_tokenizer()
NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}
# four rows: Q and R call `add` once (answers of different lengths, so their second turns
# have different budgets left), S answers at once, T's second turn runs past its budget
TURNS = {"Q": [call("add", a=2, b=3), answer("5"), "<answer>5</answer></s>"],
         "R": [call("add", a=20, b=30), answer("50"), "<answer>50</answer></s>"],
         "S": ["<answer>9</answer></s>"],
         "T": [call("add", a=1, b=1), answer("2"), "y" * 80 + "</s>"]}
BUDGET, SEEDS = 150, [5, 6, 7, 8]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_episodes")
    model = build_tiny_llama(TOK, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, max_position_embeddings=256, seed=0)
    save_checkpoint(model, TOK, root / "model")
    return {"model": model, "dir": str(root / "model"), "root": root}


def scripts() -> list[list[int]]:
    return [ids(TOK, f"<s>{q}\n" + "".join(parts)) for q, parts in TURNS.items()]


def agent(inner) -> AgentSampler:
    spec = AgentSpec({"add": add}, None, 3, 1.0)
    return AgentSampler(inner, spec)


def episodes(inner, temperature: float = 0.7):
    return agent(inner).generate([], rows=[{"prompt": q} for q in TURNS], seeds=SEEDS,
                                 params=SamplingParams(BUDGET, temperature=temperature))


def check_episodes(r) -> None:
    """Q, R, S, T as scripted: the ids, the masks, the sampler's log-probs, the cuts."""
    for i, parts in enumerate(TURNS.values()):
        model_parts = [ids(TOK, p) for p in parts[0::2]]
        tool_parts = [ids(TOK, p) for p in parts[1::2]]
        want, mask = [], []
        for k, m in enumerate(model_parts):
            want += m
            mask += [True] * len(m)
            if k < len(tool_parts):
                want += tool_parts[k]
                mask += [False] * len(tool_parts[k])
        want, mask = want[:BUDGET], mask[:BUDGET]  # T: its last turn cut at the budget
        n = len(want)
        assert r.completion_ids[i, :n].tolist() == want  # the sampled ids + the tool's, exactly
        assert r.completion_mask[i].tolist() == [True] * n + [False] * (
            r.completion_ids.shape[1] - n)
        assert r.response_mask[i, :n].tolist() == mask and not r.response_mask[i, n:].any()
        real = r.completion_mask[i]
        model, tool = r.response_mask[i], real & ~r.response_mask[i]
        assert r.logprobs[i][model].eq(fake_vllm.LOGPROB).all()  # vLLM's, on model tokens
        assert r.logprobs[i][tool].eq(0).all() and r.logprobs[i][~real].eq(0).all()
    assert [e["turns"] for e in r.episodes] == [2, 2, 1, 2]
    assert [e["cut"] for e in r.episodes] == [None, None, None, "length"]
    assert r.truncated.tolist() == [False, False, False, True]
    assert [e["tool_tokens"] for e in r.episodes] == [33, 34, 0, 33]
    assert r.rows[1]["messages"][2] == {"role": "tool", "name": "add", "content": "50"}
    assert r.completions[0].endswith("<answer>5</answer>")


def check_requests(prompts: list[list[int]], budgets: list[int], seeds: list[int]) -> None:
    """Turn 1: the four prompts, whole budget; turn 2: Q, R, T continued from their ids (prompt
    + turn 1 + tool answer, as token ids), each with its own budget left; per-turn seeds."""
    first = [ids(TOK, f"<s>{q}\n") for q in TURNS]
    second = [first[i] + ids(TOK, TURNS[q][0] + TURNS[q][1]) for i, q in ((0, "Q"), (1, "R"),
                                                                          (3, "T"))]
    assert prompts == first + second
    # Q: 70 + 33 tokens so far -> 150 - 103 = 47 left; R: 72 + 34 -> 44; T: 70 + 33 -> 47
    assert budgets == [BUDGET] * 4 + [47, 44, 47]
    assert seeds == [sequence_seed(s, "turn", 0) for s in SEEDS] + [
        sequence_seed(SEEDS[i], "turn", 1) for i in (0, 1, 3)]


def test_colocated_engine_runs_episodes_from_token_ids(world, vllm):
    from posttrain.config import GRPOConfig

    cfg = GRPOConfig(model=world["dir"], rollout_engine="vllm_colocate")
    inner = vllm_sampler.VLLMColocateSampler.from_config(cfg, TOK)
    inner.llm.scripts = scripts()
    r = episodes(inner)
    check_episodes(r)
    llm = inner.llm
    assert llm.log == [("generate", 4), ("generate", 3)]  # all live episodes of a turn at once
    prompts = [p for p, _ in llm.requests]
    assert all(set(p) == {"prompt_token_ids"} for p in prompts)  # TokensPrompt, never text
    sps = [sp for _, sp in llm.requests]
    check_requests([p["prompt_token_ids"] for p in prompts], [sp.max_tokens for sp in sps],
                   [sp.seed for sp in sps])
    for sp in sps:
        assert {k: getattr(sp, k) for k in NEUTRAL} == NEUTRAL
        assert sp.temperature == 0.7 and sp.logprobs == 0 and sp.n == 1
        assert sp.stop_token_ids == [TOK.eos_token_id] and sp.detokenize is False


def test_server_engine_runs_episodes_from_token_ids(world):
    with fake_vllm.FakeServer(world["dir"], generation_config=CHECKPOINT_DEFAULTS,
                              scripts=scripts()) as server:
        inner = vllm_server.VLLMServerSampler(server.url, TOK, [TOK.eos_token_id],
                                             group_host="127.0.0.1", group_port=51217,
                                             timeout=10)
        r = episodes(inner)
    check_episodes(r)
    bodies = server.requests  # a turn's requests run concurrently: sort by (turn, row)
    assert len(bodies) == 7 and all(isinstance(b["prompt"], list) for b in bodies)  # ids
    at, rows = len(ids(TOK, "<s>")), [ids(TOK, q)[0] for q in TURNS]
    picked = sorted(bodies, key=lambda b: (len(b["prompt"]) > at + 2,
                                           rows.index(b["prompt"][at])))
    check_requests([b["prompt"] for b in picked], [b["max_tokens"] for b in picked],
                   [b["seed"] for b in picked])
    for sp in server.resolved:  # the checkpoint's generation_config never fills a field
        assert {k: getattr(sp, k) for k in NEUTRAL} == NEUTRAL
        assert sp.temperature == 0.7 and sp.logprobs == 0


def test_greedy_episodes_have_no_sampler_logprobs(world, vllm):
    from posttrain.config import GRPOConfig

    cfg = GRPOConfig(model=world["dir"], rollout_engine="vllm_colocate")
    inner = vllm_sampler.VLLMColocateSampler.from_config(cfg, TOK)
    inner.llm.scripts = scripts()
    r = agent(inner).generate([], rows=[{"prompt": q} for q in TURNS],
                              params=SamplingParams(BUDGET, greedy=True))
    assert r.completion_ids[0, :107].tolist() == ids(TOK, "".join(TURNS["Q"]))
    assert all(sp.temperature == 0.0 and sp.logprobs is None and sp.seed is None
               for _, sp in inner.llm.requests)
    assert r.logprobs.eq(0).all()


def test_importance_weights_ignore_tool_tokens(world, vllm):
    """Every `rollout_is` mode over a vLLM episode rollout: 0 on tool tokens, and nothing at
    the tool positions (the learner's or the sampler's log-prob there, even NaN) moves a
    weight or a metric; on model tokens the token modes are min(exp(old - q), cap) (golden)."""
    from posttrain.config import GRPOConfig

    inner = vllm_sampler.VLLMColocateSampler.from_config(
        GRPOConfig(model=world["dir"], rollout_engine="vllm_colocate"), TOK)
    inner.llm.scripts = scripts()
    r = episodes(inner)
    tool = r.completion_mask & ~r.response_mask  # [N, T]
    assert tool.any()
    old = -0.5 + 0.1 * torch.randn(r.logprobs.shape, generator=torch.Generator().manual_seed(0))
    moved_old = old.masked_fill(tool, -30.0)  # [N, T] tool positions changed on both sides
    moved_q = r.logprobs.masked_fill(tool, float("nan"))
    for mode in IS_MODES:
        w, kept = rollout_weights(old, r.logprobs, r.response_mask, mode, cap=3.0)
        assert w[tool].eq(0).all() and not kept[tool].any()
        w2, kept2 = rollout_weights(moved_old, moved_q, r.response_mask, mode, cap=3.0)
        assert torch.equal(w, w2) and torch.equal(kept, kept2)
        m1 = rollout_metrics(old, r.logprobs, r.response_mask, mode, cap=3.0)
        m2 = rollout_metrics(moved_old, moved_q, r.response_mask, mode, cap=3.0)
        assert all(torch.equal(m1[k], m2[k]) for k in m1), mode
    w, _ = rollout_weights(old, r.logprobs, r.response_mask, "token_truncate", cap=3.0)
    m = r.response_mask
    # q = -0.5 on model tokens (fake_vllm.LOGPROB): w = min(exp(old + 0.5), 3)
    assert torch.allclose(w[m], torch.exp(old[m] + 0.5).clamp(max=3.0))


def test_grpo_trains_tool_episodes_on_the_colocated_engine(world, vllm, tmp_path):
    """GRPO with an environment and `rollout_engine: vllm_colocate` (no longer refused): the
    episodes come from vLLM, the correction's weights are 0 on tool tokens and on model tokens
    pi_old / q from the learner's own forward, the gap metric counts model tokens only."""
    from posttrain.trainers.grpo import GRPOTrainer
    from tests.trainers.test_grpo_tools import Counter

    script = ("<s>Q start=4\n" + call("step", by=3) + answer("7") + call("step", by=3)
              + answer("10") + "<answer>10</answer></s>")
    data = world["root"] / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "Q", "answer": "10", "start": 4}) + "\n")
    Counter.resets, Counter.calls = [], []
    t = GRPOTrainer(model=world["dir"], train_data=str(data), eval_data=str(data),
                    environment_factory=Counter, rewards=["math"], tool_schemas="none",
                    rollout_engine="vllm_colocate", rollout_is="token_truncate",
                    rollout_is_cap=1e6, group_size=2, prompts_per_step=1, max_new_tokens=200,
                    eval_max_new_tokens=200, eval_size=1, max_steps=1, progress=False,
                    report_to=[], threads=1, out_dir=str(tmp_path / "run"), temperature=0.7)
    t.defer_truncated_weights = False  # the weights at step 3, to look at them here
    sampler = t.sampler()
    sampler.inner.llm.scripts = [ids(TOK, script)]
    rollout, metrics = t.rollout_step()
    assert sampler.name == "vllm_colocate" and not sampler.runs_policy
    assert Counter.calls == [3, 3] * 2 and metrics["reward/environment_mean"] == 1.0
    assert metrics["agent/tool_calls"] == 4.0 and metrics["agent/turns_mean"] == 3.0
    assert rollout.completion_ids[0].tolist() == ids(TOK, script)[len(ids(TOK, "<s>Q start=4\n")):]
    t.compute_advantages(rollout, metrics)
    tool = rollout.completion_mask & ~rollout.response_mask
    m = rollout.response_mask
    old = t.policy_logprobs(rollout)  # the learner's forward (deterministic): pi_old
    assert rollout.is_weights[tool].eq(0).all()
    assert torch.allclose(rollout.is_weights[m], torch.exp(old[m] + 0.5), rtol=1e-5)
    gap = (old - fake_vllm.LOGPROB).abs()
    assert metrics["rollout/logprob_abs_diff"] == pytest.approx(float(gap[m].mean()), rel=1e-5)
    assert float(gap[m].mean()) != pytest.approx(float((old - rollout.logprobs).abs()[
        rollout.completion_mask].mean()), rel=1e-3)  # tool tokens would have moved it
    out = t.update(rollout)
    assert abs(out["policy/approx_kl"]) < 1e-6 and out["policy/clipfrac"] == 0.0
    assert t.evaluate("before")["accuracy"] == 1.0  # greedy held-out episodes through vLLM
