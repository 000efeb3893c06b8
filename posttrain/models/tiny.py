"""Build a tiny Llama-style causal LM from scratch (the offline demo's policy).

The model is a stock ``transformers`` ``LlamaForCausalLM``, so ``save_pretrained`` /
``AutoModelForCausalLM.from_pretrained`` work unchanged and every trainer treats it exactly like
a downloaded model. Input and output embeddings are tied (the vocabulary is ~100 tokens, so this
matters little for size but keeps the checkpoint simple).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int = 512,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` sized for ``tokenizer``'s vocabulary.

    Special-token ids (pad/bos/eos) are copied from the tokenizer into the model and its
    generation config, so ``generate`` stops at EOS and pads with PAD.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def build_tiny_gemma2(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 64,
    final_logit_softcapping: float | None = 2.0,
    sliding_window: int = 8,
    initializer_range: float = 0.2,
    seed: int = 0,
) -> torch.nn.Module:
    """A randomly initialised ``Gemma2ForCausalLM``: a model family whose forward changes the
    logits after the LM head (``final_logit_softcapping``: ``cap * tanh(logits / cap)``) and
    alternates sliding-window and global attention layers. For tests of the one logits path.

    ``initializer_range`` is large so the raw logits exceed the cap and softcapping matters.
    """
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        final_logit_softcapping=final_logit_softcapping,
        sliding_window=sliding_window,
        initializer_range=initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="eager",  # Gemma-2's attention softcapping needs eager attention
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma2ForCausalLM(config)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return model
