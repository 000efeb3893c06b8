"""The real-family fixture: real tokenizers and templates, tiny models of the real classes."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from posttrain.tasks.families import SPECS, build_tiny_model

CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama3_1": "LlamaForCausalLM",
           "gemma3": "Gemma3ForCausalLM", "gptoss": "GptOssForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}
# a marker of each real template: the tool-calling part the short or missing ones lack
TEMPLATE_MARKS = {"qwen3": "<tool_call>", "llama3_1": "Environment: ipython",
                  "gemma3": "<start_of_turn>", "gptoss": "<|channel|>",
                  "deepseek_v3": "tool▁calls▁begin"}


def test_family_loads_with_real_parts(family, family_dir, family_tokenizer):
    spec = SPECS[family]
    model = AutoModelForCausalLM.from_pretrained(family_dir)
    assert type(model).__name__ == CLASSES[family]
    assert model.config.vocab_size == spec.vocab_size >= len(family_tokenizer) - 1
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert list(model.generation_config.eos_token_id) == spec.generation_eos
    assert TEMPLATE_MARKS[family] in family_tokenizer.chat_template
    end_id = family_tokenizer.convert_tokens_to_ids(spec.end_of_turn)
    assert end_id in spec.generation_eos, "the turn's closing token must stop sampling"
    msgs = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    text = family_tokenizer.apply_chat_template(msgs, tokenize=False)
    assert spec.end_of_turn in text.rsplit("5", 1)[1]


def test_tiny_model_is_deterministic():
    a, b = build_tiny_model("deepseek_v3", seed=3), build_tiny_model("deepseek_v3", seed=3)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
