"""Models and tokenizers: the tiny offline demo model, loading by path or Hub name, LoRA."""

from posttrain.models.loading import (
    ModelLoadError,
    load_model_and_tokenizer,
    load_tokenizer,
    model_context,
)
from posttrain.models.lora import adapters_disabled, apply_lora, has_adapters
from posttrain.models.tiny import build_tiny_llama, build_tiny_qwen2, count_parameters
from posttrain.models.tokenizer import build_char_tokenizer

__all__ = ["ModelLoadError", "adapters_disabled", "apply_lora", "build_char_tokenizer",
           "build_tiny_llama", "build_tiny_qwen2", "count_parameters", "has_adapters",
           "load_model_and_tokenizer", "load_tokenizer", "model_context"]
