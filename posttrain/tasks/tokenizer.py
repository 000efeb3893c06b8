"""A character-level tokenizer for the offline demo, built with ``tokenizers``.

Vocabulary (104 tokens): ``<pad> <s> </s> <unk>``, the 95 printable ASCII characters and
``\\n``, plus the four reasoning tags ``<think> </think> <answer> </answer>`` as single added
tokens. The tags are *not* special tokens, so ``decode(..., skip_special_tokens=True)`` keeps
them. Any other character maps to ``<unk>``.

The chat template is minimal so prompts stay short: ``<s>`` once, then each user (or system)
message followed by a newline, each assistant message followed by ``</s>``. The generation
prompt adds nothing: ``render(user "12+7") == "<s>12+7\\n"`` and the model continues from the
newline. No post-processor is installed, so tokenizing a rendered prompt adds no second ``<s>``.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
REASONING_TAGS: tuple[str, ...] = ("<think>", "</think>", "<answer>", "</answer>")
CHARS: tuple[str, ...] = tuple(chr(i) for i in range(32, 127)) + ("\n",)

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- message['content'] + eos_token -}}"
    "{%- else -%}"
    "{{- message['content'] + '\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character vocabulary + reasoning tags + pad/bos/eos/unk + a minimal chat template."""
    specials = [PAD, BOS, EOS, UNK]
    vocab = {token: i for i, token in enumerate(specials + list(CHARS))}
    # BPE with no merges splits text into single characters; Fuse joins them back on decode.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in specials])
    core.add_tokens([AddedToken(t, normalized=False, special=False) for t in REASONING_TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    return tokenizer
