"""`perf/pad_fraction`: padded / all positions of the learner's (differentiated) forwards."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.padding import PAD_COUNT, pad_positions
from posttrain.engine.forward import completion_logprobs
from posttrain.engine.update import padded_step
from posttrain.tasks.tiny import build_tiny_llama
from posttrain.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer()
    return build_tiny_llama(tok, hidden_size=32, num_layers=1, num_heads=2,
                            intermediate_size=64, max_position_embeddings=64, seed=0)


def _batch() -> tuple[torch.Tensor, ...]:
    """2 rows: prompts [2, 3] left padded (2 and 3 tokens), completions [2, 4] right padded
    (2 and 1 tokens; the last 2 columns are padding in both rows and are trimmed)."""
    p_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    p_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    c_ids = torch.tensor([[10, 11, 0, 0], [12, 0, 0, 0]])
    c_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    return p_ids, p_mask, c_ids, c_mask


def test_pad_positions_golden():
    # 3 zeros among 8 positions
    assert pad_positions(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])) == (3, 8)


def test_the_learner_forward_counts_its_trimmed_batch(tiny):
    PAD_COUNT.take()
    completion_logprobs(tiny, *_batch())
    # trimmed to P' = 3, T' = 2: row 0 = [pad, 5, 6, 10, 11], row 1 = [7, 8, 9, 12, pad]:
    # 2 padded positions of 2 x 5 = 10
    assert PAD_COUNT.take() == (2, 10)
    with torch.no_grad():  # the reference, old log-probs: not the learner's arithmetic
        completion_logprobs(tiny, *_batch())
    assert PAD_COUNT.take() == (0, 0)


def test_padded_step_logs_the_fraction(tiny):
    class OneProcess:
        def sum(self, value):  # noqa: ANN001, ANN202 - Dist.sum on one process
            return value

    def step(_: int) -> dict[str, float]:
        lp, _ = completion_logprobs(tiny, *_batch())
        return {"loss/x": float(lp.detach().sum())}

    PAD_COUNT.padded = 99  # counted before the step: not the step's
    metrics = padded_step(step, 1, OneProcess())
    assert metrics["perf/pad_fraction"] == pytest.approx(2 / 10)
    assert padded_step(lambda _: {}, 2, OneProcess())["perf/pad_fraction"] == 0.0


def test_token_budget_groups_golden():
    from posttrain.engine.update import token_budget_micro_batches

    widths = [(2, 3), (5, 25), (4, 2), (2, 10), (3, 3), (1, 10)]  # (prompt, completion)
    # sorted by (completion, prompt): 2 (4, 2), 0 (2, 3), 4 (3, 3), 5 (1, 10), 3 (2, 10),
    # 1 (5, 25); budget 24 tokens = rows x (longest prompt + longest completion):
    # [2, 0, 4]: 3 x (4 + 3) = 21 (with 5: 4 x (4 + 10) = 56 > 24); [5, 3]: 2 x (2 + 10) = 24;
    # [1]: 5 + 25 = 30 > 24 alone, in a micro-batch of its own
    assert token_budget_micro_batches(list(range(6)), widths, 24) == [[2, 0, 4], [5, 3], [1]]


def test_row_widths_golden():
    from posttrain.engine.update import row_widths

    p_ids, p_mask, _, c_mask = _batch()
    # row 0: 2 prompt + 2 completion tokens; row 1: 3 + 1; a masked position inside the
    # completion (a tool's answer) still counts up to the last one that does
    assert row_widths(p_mask, c_mask) == [(2, 2), (3, 1)]
    assert row_widths(p_mask, torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]])) == [(2, 3), (3, 0)]


@pytest.mark.parametrize("key,value", [("micro_batch_tokens", 512), ("packing", True)])
def test_unsupported_trainers_refuse_in_one_line(key, value):
    from posttrain.config import ConfigError, RMConfig, build_config
    from posttrain.engine.preflight import preflight
    from posttrain.trainers.reward_model import RewardModelTrainer

    class NotYet(RewardModelTrainer):  # a trainer that says neither (every registered one packs)
        supports_packing = False

    cfg = build_config(RMConfig, overrides={"model": "m", "train_data": "d", key: value})
    with pytest.raises(ConfigError, match=f"config key '{key}': `posttrain rm` does not "
                                          "support it yet") as err:
        preflight(cfg, NotYet)
    assert "\n" not in str(err.value)


def test_packing_with_torch_compile_is_refused_in_one_line():
    from posttrain.config import ConfigError, GRPOConfig, build_config

    with pytest.raises(ConfigError, match="config key 'packing'=True: not with torch_compile") as e:
        build_config(GRPOConfig, overrides={"model": "m", "train_data": "d", "packing": True,
                                            "bf16_compute": True, "torch_compile": True})
    assert "\n" not in str(e.value)
