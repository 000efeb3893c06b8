"""GRPO with a tool on tiny models of the five real families, through
the trainer API: the sampler writes the family's native call and answer (a script over the
real vocabulary), the family's tiny model learns on the episodes; the call runs, its answer is
the template's tokens, and the first step is on-policy (KL 0)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.rollout.episodes import render_episode, takes_tools
from posttrain.rollout.sampler import SAMPLERS
from posttrain.rollout.tools import tool_schemas
from posttrain.tasks.families import FAMILIES
from posttrain.trainers.grpo import GRPOTrainer
from tests.families.test_tool_calls import ANSWER, NATIVE, add, ids
from tests.rollout.script_lm import ScriptedHF, ScriptLM

PROMPT = "What is 2+3? Use the tool."


@pytest.mark.parametrize("name", FAMILIES)
def test_grpo_with_a_tool_on_a_real_family(name, family_builder, tmp_path, monkeypatch):
    path = family_builder(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    show = "template" if takes_tools(tok) else "none"  # Gemma 3, DeepSeek V3: no schemas
    prompt = render_episode(tok, [{"role": "user", "content": PROMPT}],
                            tool_schemas([add]) if show == "template" else [])
    call = ids(tok, NATIVE[name])
    script = (ids(tok, prompt) + call + ids(tok, ANSWER[name]) + ids(tok, "<answer>5</answer>")
              + call[-1:])  # the family's end-of-turn id closes the answer too (gpt-oss: call)
    if name == "gptoss":  # its answer ends on <|return|>
        script[-1] = tok.convert_tokens_to_ids("<|return|>")
    lm = ScriptLM(script, len(tok))
    lm.generation_config = model.generation_config  # the family's end ids stop its turns

    def factory(cfg, tokenizer, *, role="eval", dist=None, model=None):
        sampler = ScriptedHF(tokenizer)
        sampler.script_model = lm
        return sampler

    monkeypatch.setitem(SAMPLERS, "hf", factory)
    rows = [{"prompt": PROMPT, "answer": "5"}] * 2
    t = GRPOTrainer(model=model, tokenizer=tok, train_data=rows, eval_data=rows[:1],
                    tools=[add], rewards=["math"], group_size=2, prompts_per_step=2,
                    max_new_tokens=96, eval_max_new_tokens=96, max_steps=1, kl_coef=0.1,
                    progress=False, report_to=[], threads=1, micro_batch_size=4,
                    out_dir=str(tmp_path / "run"), eval_size=1, tool_schemas=show)
    rollout, metrics = t.rollout_step()
    assert metrics["agent/tool_calls"] == 4.0 and metrics["agent/turns_mean"] == 2.0
    assert sum(v for k, v in metrics.items() if k.startswith("agent/tool_errors/")) == 0
    assert metrics["reward/math_mean"] == 1.0
    start = len(ids(tok, prompt))
    assert rollout.completion_ids[0, :len(script) - start].tolist() == script[start:]
    tool = (rollout.completion_mask & ~rollout.response_mask)[0]
    assert int(tool.sum()) == len(ids(tok, ANSWER[name]))
    t.compute_advantages(rollout, metrics)
    out = t.update(rollout)
    assert abs(out["policy/approx_kl"]) < 1e-6 and abs(out["kl/token_mean"]) < 1e-6
    summary = t.train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if x]
    assert summary["eval_before"] == 1.0 and any("agent/tool_calls" in x for x in lines)
