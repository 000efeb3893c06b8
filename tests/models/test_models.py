import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.data.prompts import render_prompt
from posttrain.models import (
    ModelLoadError,
    adapters_disabled,
    apply_lora,
    has_adapters,
    load_model_and_tokenizer,
)
from posttrain.models.loading import resolve_dtype
from posttrain.tasks.tiny import build_tiny_llama, build_tiny_qwen2, count_parameters
from posttrain.tasks.tokenizer import build_char_tokenizer

TRACE = "<think>12+7=19; 19*3=57; 57-5=-2</think><answer>-2</answer>"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny(tokenizer, seed=0):
    return build_tiny_llama(tokenizer, hidden_size=32, num_layers=1, num_heads=2,
                            intermediate_size=64, max_position_embeddings=128, seed=seed)


def test_vocab_and_tags_are_single_tokens(tokenizer):
    assert 100 <= len(tokenizer) <= 110
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
    ids = tokenizer(TRACE, add_special_tokens=False)["input_ids"]
    # 4 tags + every other character one token each
    assert len(ids) == 4 + len(TRACE) - len("<think></think><answer></answer>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == TRACE
    assert {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id} == {0, 1, 2}


def test_unknown_character_maps_to_unk(tokenizer):
    ids = tokenizer("1é", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tokenizer.unk_token_id


def test_chat_template(tokenizer):
    assert render_prompt(tokenizer, "12+7") == "<s>12+7\n"
    messages = [{"role": "user", "content": "12+7"}, {"role": "assistant", "content": "x"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<s>12+7\nx</s>"
    # the rendered prompt tokenizes with exactly one BOS
    ids = tokenizer(render_prompt(tokenizer, "1+2"), add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_tokenizer_and_model_round_trip(tokenizer, tmp_path):
    model = tiny(tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert tok2(TRACE)["input_ids"] == tokenizer(TRACE)["input_ids"]
    assert tok2.chat_template == tokenizer.chat_template
    assert tok2.eos_token_id == tokenizer.eos_token_id
    ids = torch.tensor([tokenizer(TRACE)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model2(ids).logits)
    model3, tok3 = load_model_and_tokenizer(tmp_path, dtype="bfloat16")
    assert next(model3.parameters()).dtype == torch.bfloat16
    assert model3.generation_config.eos_token_id == tokenizer.eos_token_id
    assert len(tok3) == len(tokenizer)


@pytest.mark.parametrize("tied", [True, False])
def test_empty_load_is_the_same_model_on_meta(tokenizer, tmp_path, tied):
    """`empty=True` (FSDP2 ranks other than 0): the same modules, names, shapes, dtype and
    weight tying as the loaded model, on the meta device, with its generation config."""
    build_tiny_llama(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                     max_position_embeddings=128, tie_word_embeddings=tied).save_pretrained(
        tmp_path)
    tokenizer.save_pretrained(tmp_path)
    full, _ = load_model_and_tokenizer(tmp_path, dtype="bfloat16")
    empty, _ = load_model_and_tokenizer(tmp_path, dtype="bfloat16", empty=True)
    assert type(empty) is type(full)
    shapes = [(n, p.shape, p.dtype) for n, p in full.named_parameters(remove_duplicate=False)]
    assert [(n, p.shape, p.dtype) for n, p in
            empty.named_parameters(remove_duplicate=False)] == shapes
    assert all(p.is_meta for p in empty.parameters())
    assert all(b.is_meta for b in empty.buffers())
    assert (empty.lm_head.weight is empty.model.embed_tokens.weight) is tied
    assert (full.lm_head.weight is full.model.embed_tokens.weight) is tied
    assert empty.generation_config.to_dict() == full.generation_config.to_dict()


def test_build_tiny_llama_sizes(tokenizer):
    model = build_tiny_llama(tokenizer, hidden_size=128, num_layers=2, num_heads=4,
                             intermediate_size=512)
    # embeddings 104*128 (tied head) + per layer: attention 4*128*128, MLP 3*128*512, 2 norms
    # of 128; + final norm 128 -> 13312 + 2*(65536 + 196608 + 256) + 128 = 538240
    assert count_parameters(model) == 538240
    assert model.config.vocab_size == len(tokenizer)
    with pytest.raises(ValueError, match="divisible"):
        build_tiny_llama(tokenizer, hidden_size=30, num_heads=4)


def test_build_tiny_qwen2_shape(tokenizer, tmp_path):
    model = build_tiny_qwen2(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                             num_kv_heads=1, intermediate_size=32, seed=0)
    # tied embeddings 151936*16 = 2430976; one layer with head_dim 8: q 16*16+16, k and v
    # 16*8+8 each, o 16*16 (no bias) -> 800; MLP 3*16*32 = 1536; 2 norms 32 -> 2368;
    # final norm 16 -> 2430976 + 2368 + 16 = 2433360
    assert count_parameters(model) == 2433360
    assert model.config.vocab_size == 151936 > len(tokenizer)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert all(p.bias is not None and p.bias.abs().sum() > 0
               for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert (model.config.pad_token_id, model.generation_config.eos_token_id) == (
        tokenizer.pad_token_id, tokenizer.eos_token_id)
    ids = torch.tensor([tokenizer(TRACE)["input_ids"]])
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(again).__name__ == "Qwen2ForCausalLM"
    assert torch.equal(model(ids).logits, again(ids).logits)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        build_tiny_qwen2(tokenizer, vocab_size=50)


def test_build_is_seeded(tokenizer):
    a, b, c = tiny(tokenizer, 0), tiny(tokenizer, 0), tiny(tokenizer, 1)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_and_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="valid"):
        resolve_dtype("float8")


def test_hub_name_offline_error_says_so(monkeypatch):
    from posttrain.data import hub

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(ModelLoadError, match="Hugging Face Hub"):
        load_model_and_tokenizer("no-such-org/no-such-model-xyz")


def test_lora_and_reference_with_adapters_disabled(tokenizer):
    model = tiny(tokenizer)
    ids = torch.tensor([tokenizer(TRACE)["input_ids"]])
    with torch.no_grad():
        base = model(ids).logits.clone()
    with pytest.raises(ValueError, match="adapters"), adapters_disabled(model):
        pass
    peft_model = apply_lora(model, r=4, alpha=8)
    assert has_adapters(peft_model)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # move the adapter away from its zero init
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
        changed = peft_model(ids).logits
        with adapters_disabled(peft_model):
            ref = peft_model(ids).logits
    assert not torch.allclose(changed, base)
    torch.testing.assert_close(ref, base)
