"""Models and tokenizers: loading by path or Hub name, LoRA, value heads, ORM/PRM reward models, and
the model execution shared by the sampler and the learner (logits context, bf16 copies)."""

from posttrain.models.loading import (
    ModelLoadError,
    load_model_and_tokenizer,
    load_tokenizer,
    model_context,
)
from posttrain.models.lora import adapters_disabled, apply_lora, has_adapters

__all__ = ["ModelLoadError", "adapters_disabled", "apply_lora", "has_adapters",
           "load_model_and_tokenizer", "load_tokenizer", "model_context"]
