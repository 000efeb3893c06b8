"""GRPO with tools and environments, TRL-style (docs/agents.md): a scripted sampler writes
the tool calls, the tiny Llama learns on the episodes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.models.loading import save_checkpoint
from posttrain.rollout.sampler import SAMPLERS
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer
from posttrain.trainers.grpo import GRPOTrainer
from posttrain.trainers.ppo import PPOTrainer
from tests.rollout.conftest import vllm  # noqa: F401 - the vLLM stand-in (a fixture)
from tests.rollout.script_lm import ScriptedHF, ScriptLM, ids

TOK = build_char_tokenizer()


class Counter:
    """TRL-style environment: reset per rollout, methods are tools, get_reward scores."""

    resets: list[dict] = []
    calls: list[int] = []

    def reset(self, **row: object) -> str:
        Counter.resets.append(dict(row))
        self.total = int(row["start"])
        return f" start={self.total}"

    def step(self, by: int) -> str:
        """Add to the counter and read it.

        Args:
            by: how much to add.
        """
        Counter.calls.append(by)
        self.total += by
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total == 10)


def seen_env(completions: list[str], environments: list, messages: list, **_: object
             ) -> list[float]:
    """A TRL-form reward that reads the episode (its environment and messages)."""
    return [float(len(m) == 6 and e.total == 10) * 0.5
            for e, m in zip(environments, messages, strict=True)]


def call(name: str, **args: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call></s>"


@pytest.fixture
def scripted(monkeypatch):
    """The hf sampler samples from a script: call step(3), read 7, call step(3), read 10,
    answer; the policy (a tiny Llama) is what trains."""
    script = ("<s>Q start=4\n" + call("step", by=3) + "<tool_response>7</tool_response>\n"
              + call("step", by=3) + "<tool_response>10</tool_response>\n<answer>10</answer></s>")
    lm = ScriptLM(ids(TOK, script), len(TOK))

    def factory(cfg, tokenizer, *, role="eval", dist=None, model=None):
        sampler = ScriptedHF(tokenizer)
        sampler.script_model = lm
        if model is not None:
            sampler.update_weights(model, 0)
        return sampler

    monkeypatch.setitem(SAMPLERS, "hf", factory)
    Counter.resets, Counter.calls = [], []
    return script


def trainer(tmp_path, cls: type = GRPOTrainer, **kw: object) -> GRPOTrainer | PPOTrainer:
    model = build_tiny_llama(TOK, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, max_position_embeddings=256, seed=0)
    rows = [{"prompt": "Q", "answer": "10", "start": 4}] * 4
    keys = {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 200, "max_steps": 1,
            "eval_max_new_tokens": 200,
            "kl_coef": 0.1, "progress": False, "report_to": [], "threads": 1,
            "tool_schemas": "none",  # the char template renders no schemas; the script knows
            "out_dir": str(tmp_path / "run"), "eval_size": 2, "micro_batch_size": 4}
    return cls(model=model, tokenizer=TOK, train_data=rows, eval_data=rows[:2],
               **{**keys, **kw})


def test_trl_style_environment_script_runs_and_learns_on_model_tokens(tmp_path, scripted):
    t = trainer(tmp_path, rewards=["math", seen_env], environment_factory=Counter,
                max_tool_calling_iterations=4)
    assert [r["name"] for r in t.cfg.rewards] == ["math", "seen_env", "environment"]
    rollout, metrics = t.rollout_step()
    # reset once per rollout with the row; the environment's tool got the model's calls
    assert len(Counter.resets) == 4 and Counter.resets[0]["start"] == 4
    assert Counter.calls == [3, 3] * 4
    assert metrics["reward/environment_mean"] == 1.0 and metrics["reward/seen_env_mean"] == 0.5
    assert metrics["agent/tool_calls"] == 8.0 and metrics["agent/turns_mean"] == 3.0
    assert metrics["agent/cut_by_turns"] == 0.0 and metrics["agent/tool_errors/exception"] == 0
    # token in, token out: the learner's ids are the script after the prompt, exactly
    want = ids(TOK, scripted)[len(ids(TOK, "<s>Q start=4\n")):]
    assert rollout.completion_ids[0].tolist() == want
    tool_tokens = (rollout.completion_mask & ~rollout.response_mask).sum(1)
    assert tool_tokens.tolist() == [33 + 34] * 4  # "<tool_response>7</tool_response>\n", "10"
    assert (rollout.logprobs[~rollout.response_mask] == 0).all()
    # first update: ratio 1 and KL 0 on the model's tokens
    t.compute_advantages(rollout, metrics)
    out = t.update(rollout)
    assert abs(out["policy/approx_kl"]) < 1e-6 and out["policy/clipfrac"] == 0.0
    assert abs(out["kl/token_mean"]) < 1e-6


def test_ppo_reads_tool_answers_and_trains_on_model_tokens_only(tmp_path, scripted):
    """PPO on the same episodes: the policy's, the reference's and the critic's forwards read
    the tool answers (values and log-probs equal a forward over the whole episode, not one
    with the tool answers hidden), and advantages, returns and values are 0 on them."""
    t = trainer(tmp_path, PPOTrainer, rewards=["math"], environment_factory=Counter,
                ppo_epochs=1, mini_batches=2)
    with torch.no_grad():  # a critic whose values depend on what it reads (zero head: all 0)
        t.critic.head.weight.normal_(generator=torch.Generator().manual_seed(0))
    rollout, scores, metrics = t.rollout_and_score()
    assert metrics["agent/tool_calls"] == 8.0 and scores.tolist() == [2.0] * 4  # math + env
    batch = t.prepare(rollout, scores, metrics)
    model, tool = batch.response_mask, batch.completion_mask & ~batch.response_mask
    assert int(tool.sum()) == 4 * (33 + 34)
    for field in (batch.values, batch.advantages, batch.returns):
        assert (field[tool] == 0).all() and (field[model] != 0).any()
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids)
    whole = t.forward.batched(t.model, *args, batch.completion_mask, 4)  # [4, T]
    hidden = t.forward.batched(t.model, *args, batch.response_mask, 4)
    torch.testing.assert_close(batch.old_logprobs[model], whole[model])
    assert not torch.allclose(hidden[model], whole[model], atol=1e-3)
    with torch.no_grad():
        v_whole = t.critic(*args[:2], args[2], batch.completion_mask)  # [4, T]
        v_hidden = t.critic(*args[:2], args[2], batch.response_mask)
    torch.testing.assert_close(batch.values[model], v_whole[model])
    assert not torch.allclose(v_hidden[model], v_whole[model], atol=1e-3)
    # the first update: ratio 1, KL 0; the critic's loss is against the same values
    n = float(model.sum())
    _, m = t.micro_loss(batch, {"tokens": n, "seqs": 4.0, "policy_tokens": n,
                                "policy_seqs": 4.0}, train_policy=True)
    assert abs(float(m["policy/ratio_max"]) - 1) < 1e-5 and float(m["policy/clipfrac"]) == 0
    assert abs(float(m["policy/ratio_min"]) - 1) < 1e-5 and metrics["kl/mean"] < 1e-5
    expected = 0.5 * float(((batch.values - batch.returns)[model] ** 2).mean())
    assert float(m["loss/value"]) == pytest.approx(expected, rel=1e-5)


def test_train_logs_agent_metrics_and_evaluates_episodes(tmp_path, scripted):
    summary = trainer(tmp_path, rewards=["math"], environment_factory=Counter).train()
    assert summary["eval_before"] == 1.0  # greedy held-out episodes with the tools
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
             if x]
    line = next(x for x in lines if "agent/episodes" in x)
    assert line["agent/episodes"] == 4.0 and 0 < line["agent/tool_token_share"] < 1


def test_refused_where_not_implemented(tmp_path):
    def calc(expression: str) -> str:
        """Calc.

        Args:
            expression: it.
        """
        return expression

    # PPO runs episodes (test above); a prompt-RL trainer that does not declare it is refused
    untested = type("Untested", (PPOTrainer,), {"supports_tools": False, "name": "untested"})
    with pytest.raises(ConfigError, match="config key 'tools'.*the untested trainer"):
        untested(model="x", train_data=[{"prompt": "a", "answer": "1"}], tools=[calc],
                 out_dir=str(tmp_path / "p"))
    with pytest.raises(ConfigError, match="config key 'tools': cannot import"):
        GRPOTrainer(model="x", train_data=[{"prompt": "a", "answer": "1"}],
                    tools=["nowhere.mod:calc"], out_dir=str(tmp_path / "h"))
    assert torch.is_tensor(torch.zeros(1))


def boom(by: int) -> str:
    """Always fails.

    Args:
        by: ignored.
    """
    raise RuntimeError("the service is down")


def test_a_tool_failing_on_most_calls_stops_the_run(tmp_path, scripted):
    from posttrain.rollout.episodes import ToolFailureError

    class Broken(Counter):
        step = staticmethod(boom)

    t = trainer(tmp_path, rewards=["math"], environment_factory=Broken)
    # one call per episode: the error answer is longer than the script expects, so the
    # scripted sampler garbles its second call
    with pytest.raises(ToolFailureError, match="'step' failed on 4 of its 4 calls.*down"):
        t.rollout_step()


def test_episodes_share_the_prompt_with_the_same_logprobs(tmp_path, scripted):
    """`share_prompt_prefix` holds for episodes: each prompt runs once and its episodes (tool
    answers read through `attention_mask`) get the plain forward's log-probs."""
    t = trainer(tmp_path, rewards=["math"], environment_factory=Counter)
    assert t.forward.share_prefix
    rollout, _ = t.rollout_step()
    assert (rollout.attention_mask & ~rollout.response_mask).any()  # tool tokens are read
    shared = t.policy_logprobs(rollout)
    plain = dataclasses.replace(t.forward, share_prefix=False).batched(
        t.learner(), rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
        rollout.attention_mask, 4)
    mask = rollout.attention_mask
    assert (shared - plain)[mask].abs().max() < 1e-5 and plain[mask].std() > 0


def test_ppo_on_vllm_colocate_corrects_model_tokens_only(tmp_path, vllm):  # noqa: F811
    """PPO's episodes from vLLM (the stand-in): the correction's weights are 0 on tool tokens
    and pi_old / q on model tokens (q = fake_vllm.LOGPROB), the first update starts at ratio 1."""
    from tests.rollout import fake_vllm
    from tests.rollout.test_episodes import answer
    model = build_tiny_llama(TOK, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32, max_position_embeddings=256, seed=0)
    save_checkpoint(model, TOK, tmp_path / "model")
    script = ("<s>Q start=4\n" + call("step", by=3) + answer("7") + call("step", by=3)
              + answer("10") + "<answer>10</answer></s>")
    rows = [{"prompt": "Q", "answer": "10", "start": 4}]
    t = PPOTrainer(model=str(tmp_path / "model"), train_data=rows, eval_data=rows,
                   environment_factory=Counter, rewards=["math"], rollout_engine="vllm_colocate",
                   rollout_is="token_truncate", rollout_is_cap=1e6, group_size=2,
                   prompts_per_step=1, max_new_tokens=200, eval_max_new_tokens=200, eval_size=1,
                   max_steps=1, progress=False, report_to=[], threads=1, ppo_epochs=1,
                   mini_batches=1, out_dir=str(tmp_path / "run"), temperature=0.7,
                   tool_schemas="none")
    t.sampler().inner.llm.scripts = [ids(TOK, script)]
    rollout, scores, metrics = t.rollout_and_score()
    assert metrics["agent/tool_calls"] == 4.0 and scores.tolist() == [2.0, 2.0]
    batch = t.prepare(rollout, scores, metrics)
    tool, m = batch.completion_mask & ~batch.response_mask, batch.response_mask
    assert tool.any() and batch.is_weights[tool].eq(0).all()
    torch.testing.assert_close(batch.is_weights[m], torch.exp(batch.old_logprobs[m]
                                                              - fake_vllm.LOGPROB))
    n = float(m.sum())
    _, out = t.micro_loss(batch, {"tokens": n, "seqs": 2.0, "policy_tokens": n,
                                  "policy_seqs": 2.0}, train_policy=True)
    assert abs(float(out["policy/ratio_max"]) - 1) < 1e-5


def echo(text: str) -> str:
    """Echo.

    Args:
        text: anything.
    """
    return text


def test_a_template_that_renders_no_tools_is_refused_unless_told(tmp_path):
    """Issue 48.2: the demo's chat template has no `tools`, so the schemas would be dropped
    without a word and the model make no call; refused before the model loads (TRL refuses
    such a template) unless `tool_schemas: none` says the model knows its tools."""
    with pytest.raises(ConfigError, match=r"^config key 'tool_schemas'=template: the chat "
                                          r"template .* renders no tool schemas"):
        trainer(tmp_path, tools=[echo], tool_schemas="template")
    assert trainer(tmp_path / "b", tools=[echo]).agent is not None  # tool_schemas: none


def test_an_environment_reward_alone_when_no_rewards_are_given(tmp_path):
    """Issue 48.3: an environment with `get_reward` and no `rewards` trains on the environment
    alone, as TRL does (not on math + format + environment); `rewards: []` is valid then."""
    t = trainer(tmp_path, environment_factory=Counter)  # rewards: the config's default
    assert [r["name"] for r in t.cfg.rewards] == ["environment"]
    t = trainer(tmp_path / "b", environment_factory=Counter, rewards=[])
    assert [r["name"] for r in t.cfg.rewards] == ["environment"]
    t = trainer(tmp_path / "c", environment_factory=Counter, rewards=["math"])
    assert [r["name"] for r in t.cfg.rewards] == ["math", "environment"]


def test_tools_on_a_tokenizer_without_template_and_plain_prompts(tmp_path):
    """Issue 48.6: no chat template, plain string prompts: the episode's prompt is the string
    itself (docs/agents.md), not a TemplateError after the model loaded (no template renders
    schemas: `tool_schemas: none`, else the one-line refusal above)."""
    from posttrain.rollout.episodes import render_episode

    bare = build_char_tokenizer()
    bare.chat_template = None
    assert render_episode(bare, [{"role": "user", "content": "Q start=4"}], []) == "Q start=4"
    model = build_tiny_llama(bare, hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64, max_position_embeddings=256, seed=0)
    t = GRPOTrainer(model=model, tokenizer=bare, train_data=[{"prompt": "Q", "answer": "1"}] * 2,
                    tools=[echo], chat_template="none", tool_schemas="none",
                    group_size=2, prompts_per_step=1,
                    max_new_tokens=8, progress=False, report_to=[], threads=1,
                    out_dir=str(tmp_path / "run"))
    rollout, _, _ = t.sample_prompts(1)
    assert rollout.num_sequences == 2


def huge(x: str) -> str:
    """Answer at length.

    Args:
        x: anything.
    """
    return "9" * 100_000


def test_a_tool_answer_that_does_not_fit_is_named(tmp_path, capsys, monkeypatch):
    """Issue 48.13: a 100,000-character tool answer ended the episode with a warning to raise
    max_new_tokens; now the warning names the tool's answer (agent/cut_by_tool_answer)."""
    from posttrain.rollout.episodes import episode_metrics

    lm = ScriptLM(ids(TOK, "<s>Q\n" + call("huge", x="a") + "x" * 300), len(TOK))

    def factory(cfg, tokenizer, *, role="eval", dist=None, model=None):
        sampler = ScriptedHF(tokenizer)
        sampler.script_model = lm
        return sampler

    monkeypatch.setitem(SAMPLERS, "hf", factory)
    t = trainer(tmp_path, tools=[huge], max_new_tokens=120)
    rollout, _, _ = t.sample_prompts(1)
    counts, _ = episode_metrics(rollout.episodes)
    assert counts["agent/cut_by_tool_answer"] == 2.0
    t.agent_metrics(rollout)
    err = capsys.readouterr().err
    assert "because a tool's answer (up to" in err and "bound what the tool returns" in err


def test_rows_naming_no_known_environment_are_refused_before_the_model_loads(tmp_path):
    """Issue 48.11: with `{name: Cls}`, a row without a known `environment` field is one config
    line naming the row, before any model loads (the model path here does not exist)."""
    rows = [{"prompt": "Q", "answer": "1", "environment": "counter"},
            {"prompt": "Q", "answer": "1"}]
    with pytest.raises(ConfigError, match=r"config key 'environment': row 2 of train_data has "
                                          r"environment=None"):
        GRPOTrainer(model="__never_loaded__", tokenizer=TOK, train_data=rows,
                    environment_factory={"counter": Counter}, tool_schemas="none",
                    group_size=2, prompts_per_step=1, progress=False, report_to=[],
                    out_dir=str(tmp_path / "run"))
