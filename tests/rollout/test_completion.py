"""vLLM outputs -> Rollout, with fake objects shaped like vLLM's RequestOutput /
CompletionOutput / Logprob and like one choice of the HTTP server's /v1/completions answer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from posttrain.rollout.completion import Completion, completion_of, to_rollout
from posttrain.rollout.vllm_sampler import request_seeds
from posttrain.rollout.vllm_server import server_choice
from posttrain.tasks.tokenizer import build_char_tokenizer

EOS, END, PAD = 2, 3, 0


@dataclass
class Logprob:
    logprob: float
    rank: int = 1


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    index: int = 0


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput] = field(default_factory=list)


def _out(tokens: list[int], finish: str, lps: list[float] | None = None) -> RequestOutput:
    lps = lps if lps is not None else [-0.5 - k for k in range(len(tokens))]
    # vLLM's entry holds the sampled token and (here) a more likely other one
    entries = [{t: Logprob(lp, 2), 99: Logprob(-0.01, 1)} for t, lp in zip(tokens, lps,
                                                                          strict=True)]
    return RequestOutput([CompletionOutput(tokens, entries, finish)])


def _prompts(n: int = 2, group_size: int = 1) -> list[list[int]]:
    return [p for p in [[10, 11], [12, 13, 14]][:n] for _ in range(group_size)]


def _convert(outputs, group_size=2, stops=(EOS,), rows=None, tokenizer=None):
    return to_rollout(outputs, prompts=_prompts(len(outputs) // group_size, group_size),
                      group_size=group_size, stop_ids=list(stops), pad_token_id=PAD,
                      tokenizer=tokenizer, rows=rows)


def test_eos_is_inside_the_mask_and_length_rows_are_truncated():
    r = _convert([_out([5, 6, EOS], "stop"), _out([7, 8, 9, 5], "length"),
                  _out([EOS], "stop"), _out([5, 5], "length")])
    assert r.completion_ids.tolist() == [[5, 6, EOS, PAD], [7, 8, 9, 5], [EOS, PAD, PAD, PAD],
                                         [5, 5, PAD, PAD]]
    assert r.response_mask.tolist() == [[True, True, True, False], [True] * 4,
                                        [True, False, False, False], [True, True, False, False]]
    assert r.truncated.tolist() == [False, True, False, True]
    # the sampled token's log-prob, not the most likely entry's; 0 where masked
    assert r.logprobs[0].tolist() == [-0.5, -1.5, -2.5, 0.0]
    assert r.logprobs[2].tolist() == [-0.5, 0.0, 0.0, 0.0]
    assert r.logprobs.dtype == torch.float32


def test_groups_are_contiguous_with_their_prompt_and_row():
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    r = _convert([_out([5, EOS], "stop") for _ in range(4)], rows=rows)
    assert r.prompt_ids.tolist() == [[PAD, 10, 11]] * 2 + [[12, 13, 14]] * 2  # left padded
    assert r.prompt_mask.tolist() == [[False, True, True]] * 2 + [[True] * 3] * 2
    assert [x["prompt"] for x in r.rows] == ["a", "a", "b", "b"]
    assert r.group_size == 2 and r.num_sequences == 4


def test_any_of_several_stop_ids_ends_a_completion_at_its_first():
    # END is a chat turn's end; tokens after the first stop (never sent by vLLM) are cut
    r = _convert([_out([5, END], "stop"), _out([EOS, 5, END], "stop")], group_size=1,
                 stops=(EOS, END))
    assert r.response_mask.tolist() == [[True, True], [True, False]]
    assert r.completion_ids.tolist() == [[5, END], [EOS, PAD]]
    assert r.truncated.tolist() == [False, False]


def test_empty_completions():
    r = _convert([_out([], "length"), _out([], "length")], group_size=1)
    assert r.completion_ids.shape == (2, 0) and r.logprobs.shape == (2, 0)
    assert r.truncated.tolist() == [True, True]
    mixed = _convert([_out([], "length"), _out([5, EOS], "stop")], group_size=1)
    assert mixed.response_mask.tolist() == [[False, False], [True, True]]
    assert mixed.completion_lengths.tolist() == [0, 2]


def test_texts_are_decoded_like_the_hf_engine():
    tok = build_char_tokenizer()
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    eos = tok.eos_token_id
    ids = tok("xy", add_special_tokens=False)["input_ids"]
    r = to_rollout([_out([a, b, eos], "stop"), _out([b], "length")], prompts=[ids, ids],
                   group_size=2, stop_ids=[eos],
                   pad_token_id=tok.pad_token_id, tokenizer=tok)
    assert r.completions == ["ab", "b"]


def test_inconsistent_outputs_are_errors():
    with pytest.raises(ValueError, match="no stop id"):  # stop without a stop token
        _convert([_out([5, 6], "stop")], group_size=1)
    with pytest.raises(ValueError, match="aborted"):
        _convert([_out([5], "abort")], group_size=1)
    with pytest.raises(ValueError, match="3 vLLM outputs for 2 prompts x 2"):
        to_rollout([_out([5], "length")] * 3, prompts=_prompts(2, 2), group_size=2,
                   stop_ids=[EOS], pad_token_id=PAD)
    bad = RequestOutput([CompletionOutput([5, 6], [{5: Logprob(-1.0)}], "length")])
    with pytest.raises(ValueError, match="1 logprob entries for 2 tokens"):
        completion_of(bad)
    missing = RequestOutput([CompletionOutput([5], [{7: Logprob(-1.0)}], "length")])
    with pytest.raises(ValueError, match="sampled token 5"):
        completion_of(missing)
    with pytest.raises(ValueError, match="one completion per request"):
        completion_of(RequestOutput([CompletionOutput([5], None, "length")] * 2))


def test_greedy_outputs_without_logprobs_get_zeros():
    out = RequestOutput([CompletionOutput([5, EOS], None, "stop")])
    r = _convert([out], group_size=1)
    assert r.logprobs.tolist() == [[0.0, 0.0]] and r.response_mask.all()


def test_server_choices_with_token_ids_or_token_id_strings():
    plain = {"token_ids": [5, EOS], "finish_reason": "stop",
             "logprobs": {"token_logprobs": [-0.25, -0.75], "tokens": ["x", "y"]}}
    assert server_choice(plain) == Completion([5, EOS], [-0.25, -0.75], "stop")
    older = {"finish_reason": "length",
             "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:7"]}}
    assert server_choice(older) == Completion([7], [-1.0], "length")
    r = _convert([server_choice(plain), server_choice(older)], group_size=1)
    assert r.logprobs.tolist() == [[-0.25, -0.75], [-1.0, 0.0]]
    assert r.truncated.tolist() == [False, True]


def test_request_seeds():
    assert request_seeds([4, 5], 2, None, greedy=False) == [4, 5]
    assert request_seeds([4, 5], 2, None, greedy=True) == [None, None]
    a = request_seeds(None, 3, torch.Generator().manual_seed(1), greedy=False)
    b = request_seeds(None, 3, torch.Generator().manual_seed(1), greedy=False)
    assert a == b and len(set(a)) == 3
    with pytest.raises(ValueError, match="1 seeds for 2"):
        request_seeds([1], 2, None, greedy=False)
