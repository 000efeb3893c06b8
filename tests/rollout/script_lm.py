"""A scripted causal LM for multi-turn tests: at absolute position p it predicts token
`script[p + 1]` with probability ~1, whatever the context. So an episode whose prompt has the
script's prompt length writes the script's model turns, and after a tool answer of the length
the script expects it goes on where the script does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from transformers import LlamaConfig

from posttrain.rollout.sampler import HFSampler


class ScriptLM(torch.nn.Module):
    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, intermediate_size=8)
        self.script, self.vocab = torch.tensor(script), vocab

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False,
                logits_to_keep: int = 0, past_key_values: Any = None, **_: Any) -> Any:
        pos = position_ids[:, -logits_to_keep:] if logits_to_keep else position_ids
        nxt = self.script[(pos + 1).clamp(max=len(self.script) - 1)]  # [n, l]
        logits = torch.full((*pos.shape, self.vocab), -50.0)
        return SimpleNamespace(logits=logits.scatter(-1, nxt[..., None], 50.0))


class ScriptedHF(HFSampler):
    """The `hf` sampler, but sampling from `script_model` whatever policy it is handed."""

    script_model: torch.nn.Module | None = None

    def sampling_model(self) -> tuple[torch.nn.Module, bool]:
        assert self.script_model is not None
        return self.script_model, False


def ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]
