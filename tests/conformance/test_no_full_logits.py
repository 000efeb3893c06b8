"""No fp32 [N, T, V] tensor in any trainer's step at a 65,536-token vocabulary.

Every aten op's output during one `step()` of each registered trainer is recorded with a
dispatch mode (`tests/engine/test_no_full_logits.py`'s recorder); no fp32 tensor whose last
dimension is V may hold more than one block of the fused head. The micro-batches are sized so
that full logits would hold over 2 blocks (where the forward fuses the head). The control
turns the fused head off and must see the full logits, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.engine import forward
from posttrain.models.loading import save_checkpoint
from posttrain.ops.fused_head import DEFAULT_BLOCK_ELEMENTS
from posttrain.tasks.tokenizer import build_char_tokenizer
from tests.conformance.conftest import CASES, build, case_keys
from tests.engine.test_no_full_logits import _LargestVocabTensor

V = 65_536
pytestmark = pytest.mark.slow
BIG = {"max_new_tokens": 40, "micro_batch_size": 16, "batch_size": 16, "group_size": 4,
       "prompts_per_step": 4, "max_steps": 1, "save_every": 0}


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> str:
    """A 1-layer Llama with a 65,536-token vocabulary over the character tokenizer (ids past
    the tokenizer's decode to nothing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("big_vocab") / "model"
    save_checkpoint(LlamaForCausalLM(config), tok, path)
    return str(path)


def _largest(world, big_model, tmp_path, case) -> int:
    trainer = build(case, case_keys(world, case, tmp_path, model=big_model, **BIG))
    trainer.model.train()
    with _LargestVocabTensor() as rec:
        trainer.step(1)
    return rec.largest


@pytest.mark.parametrize("case", CASES)
def test_no_full_fp32_logits_in_any_trainer_step(world, big_model, tmp_path, case):
    assert _largest(world, big_model, tmp_path, case) <= DEFAULT_BLOCK_ELEMENTS


def test_control_the_unfused_forward_is_seen(world, big_model, tmp_path, monkeypatch):
    monkeypatch.setattr(forward, "fused_head_supported", lambda model: False)
    assert _largest(world, big_model, tmp_path, "sft") > 2 * DEFAULT_BLOCK_ELEMENTS
