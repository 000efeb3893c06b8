"""No token trained past a turn's end, for every real family (issue 55, item 4).

SFT, DPO, KTO and the reward model train ids that end exactly at the template's end-of-turn
token (one end token, nothing after it: not Qwen's / Gemma's trailing newline, not a second
EOS); the sampler of GRPO / PPO stops on every end id of the model's generation_config.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.data.pairs import tokenize_pairs, tokenize_unpaired
from posttrain.data.prompts import render_prompt, turn_end_id
from posttrain.rollout.hf import SamplingParams, sample_tokens, stop_token_ids
from posttrain.tasks.families import SPECS
from posttrain.trainers.reward_model import encode
from posttrain.trainers.sft import collate_sft, tokenize_sft_rows

USER = [{"role": "user", "content": "What is 2+3?"}]
CHAT = {"prompt": USER, "completion": [{"role": "assistant", "content": "It is 5."}]}
PLAIN = {"prompt": "What is 2+3?", "completion": "It is 5."}


def ends(family: str, tok) -> set[int]:
    """Every id that ends a turn for `family`: generation_config's, the tokenizer's EOS and the
    template's closing token."""
    end = tok.convert_tokens_to_ids(SPECS[family].end_of_turn)
    return {*SPECS[family].generation_eos, tok.eos_token_id, end} - {None}


def check_one_end(ids: list[int], family: str, tok) -> None:
    """`ids` (the trained completion ids) end with the family's end-of-turn, the only end id."""
    end = tok.convert_tokens_to_ids(SPECS[family].end_of_turn)
    found = [i for i in ids if i in ends(family, tok)]
    assert ids[-1] == end and found == [end], (family, tok.decode(ids[-4:]))


def test_turn_end_id_is_the_templates_closing_token(family, family_tokenizer):
    end = turn_end_id(family_tokenizer)
    assert family_tokenizer.convert_ids_to_tokens(end) == SPECS[family].end_of_turn
    assert end in SPECS[family].generation_eos, "sampling must stop where training ends"


def test_sft_trains_up_to_the_turn_end_exactly(family, family_tokenizer):
    tok = family_tokenizer
    examples, dropped = tokenize_sft_rows(tok, [CHAT, PLAIN], max_len=512)
    assert dropped == 0
    batch = collate_sft(examples, pad_id=0)
    for i, row in enumerate((CHAT, PLAIN)):
        trained = batch["completion_ids"][i][batch["response_mask"][i]].tolist()
        check_one_end(trained, family, tok)
        assert "It is 5." in tok.decode(trained)
        if row is CHAT:  # the template's own rendering, cut right after its end-of-turn
            full = tok.apply_chat_template(USER + row["completion"], tokenize=False)
            prompt = render_prompt(tok, USER)
            text = full[len(prompt):]
            cut = text[:text.rindex(SPECS[family].end_of_turn) + len(SPECS[family].end_of_turn)]
            assert trained == tok(cut, add_special_tokens=False)["input_ids"]
            assert text[len(cut):].strip() == ""  # only the template's trailing newline dropped


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_preference_sides_end_at_the_turn_end(family, family_tokenizer, kind):
    tok = family_tokenizer
    other = [{"role": "assistant", "content": "It is 6."}]
    if kind == "dpo":
        rows = [{"prompt": USER, "chosen": CHAT["completion"], "rejected": other},
                {"prompt": PLAIN["prompt"], "chosen": "It is 5.", "rejected": "It is 6."}]
        pairs = tokenize_pairs(tok, rows, 512, "rows.jsonl")
    else:
        rows = [{**CHAT, "label": True}, {"prompt": USER, "completion": other, "label": False}]
        pairs = tokenize_unpaired(tok, rows, 512, "rows.jsonl")
    for ids, mask in ((pairs.chosen_ids, pairs.chosen_mask),
                      (pairs.rejected_ids, pairs.rejected_mask)):
        for i in range(len(rows)):
            check_one_end(ids[i][mask[i]].tolist(), family, tok)


def test_reward_model_sequences_end_at_the_turn_end(family, family_tokenizer):
    tok = family_tokenizer
    for row in (CHAT, PLAIN):
        (seq,) = encode(tok, [row], "completion", 512, "rows.jsonl")
        prompt_len = len(tok(render_prompt(tok, row["prompt"]), add_special_tokens=False)
                         ["input_ids"])
        check_one_end(seq[prompt_len:], family, tok)


def test_sampler_stops_on_every_generation_end_id(family, family_dir, family_tokenizer):
    """With each of generation_config's end ids made likely (a logit bias of +12 on the head),
    every sampled completion is masked through its first end id and not after it."""
    tok = family_tokenizer
    model = AutoModelForCausalLM.from_pretrained(family_dir).eval()
    stops = stop_token_ids(model, tok)
    assert set(SPECS[family].generation_eos) <= set(stops)
    prompt = tok(render_prompt(tok, USER), add_special_tokens=False, return_tensors="pt")
    for end in SPECS[family].generation_eos:
        bias = torch.zeros(model.config.vocab_size)
        bias[end] = 12.0
        hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out, b=bias:
                                                                   out + b)
        try:
            ids, mask, _, truncated = sample_tokens(
                model, prompt.input_ids, prompt.attention_mask.bool(),
                SamplingParams(max_new_tokens=12), stops, 0,
                generator=torch.Generator().manual_seed(0), group_size=8)
        finally:
            hook.remove()
        assert (~truncated).sum() >= 6, "the biased end id should end most rows"
        for row, m, cut in zip(ids.tolist(), mask.tolist(), truncated.tolist(), strict=True):
            kept = [t for t, keep in zip(row, m, strict=True) if keep]
            assert m == sorted(m, reverse=True), "the mask is a prefix"
            found = [t for t in kept if t in stops]
            assert found == ([] if cut else [end]) and (cut or kept[-1] == end)
