"""Build tiny causal LMs from scratch: a Llama (the offline demo's policy), a Qwen2 with the real
151,936-row vocabulary (GPU smoke tests and probes) and a Gemma-2 (tests of logit softcapping).

Each is a stock ``transformers`` model (``LlamaForCausalLM``...), so ``save_pretrained`` /
``AutoModelForCausalLM.from_pretrained`` work unchanged and every trainer treats it exactly like
a downloaded model. The Llama's input and output embeddings are tied (its vocabulary is ~100
tokens, so this matters little for size but keeps the checkpoint simple).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    """The tokenizer's pad/bos/eos ids, for the model config and its generation config."""
    return {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}


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
        **_special_ids(tokenizer),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    for key, value in _special_ids(tokenizer).items():  # generate stops at EOS, pads with PAD
        setattr(model.generation_config, key, value)
    return model


QWEN2_VOCAB_SIZE = 151_936
"""Vocabulary size of the Qwen2 / Qwen2.5 checkpoints (their LM head's rows)."""


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    *,
    vocab_size: int = QWEN2_VOCAB_SIZE,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    bias_std: float = 0.02,
    seed: int = 0,
) -> torch.nn.Module:
    """A randomly initialised ``Qwen2ForCausalLM`` with the real Qwen2 shape features: a
    151,936-row vocabulary (by default, whatever the tokenizer's size), tied embeddings, biases
    on the q/k/v projections and grouped-query attention. For GPU smoke tests and probes of the
    full-vocabulary LM head without a download.

    ``vocab_size`` must be at least ``len(tokenizer)`` so every tokenizer id is a row of the
    embedding; the rows above it are ids the tokenizer never produces (a real Qwen2 checkpoint
    has 271 of those too): sampled, they decode to nothing. The q/k/v biases are drawn from
    N(0, ``bias_std``) instead of transformers' zeros, so code that drops a bias shows.
    Special-token ids are copied from the tokenizer as in :func:`build_tiny_llama`.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's "
                         f"{len(tokenizer)} tokens")
    if hidden_size % num_heads or num_heads % (num_kv_heads or num_heads):
        raise ValueError(f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads="
                         f"{num_kv_heads}: heads must divide the hidden size and kv heads the "
                         "heads")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        **_special_ids(tokenizer),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, bias_std)
    for key, value in _special_ids(tokenizer).items():  # generate stops at EOS, pads with PAD
        setattr(model.generation_config, key, value)
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
