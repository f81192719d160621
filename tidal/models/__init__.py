"""Model wrappers over Hugging Face models: loading, precision, forward passes and log-probs."""

from tidal.models.forward import model_inputs, packed_attention_mask, token_logprobs
from tidal.models.loading import apply_lora, load_causal_lm, load_tokenizer
from tidal.models.precision import Precision, resolve_dtype

__all__ = [
    "Precision",
    "apply_lora",
    "load_causal_lm",
    "load_tokenizer",
    "model_inputs",
    "packed_attention_mask",
    "resolve_dtype",
    "token_logprobs",
]
