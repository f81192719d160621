"""Model code of the rollout engine: one decoder for the Llama / Mistral / Qwen2 / Qwen3 families."""

from tidal.rollout.models.decoder import SUPPORTED_MODEL_TYPES, DecoderArgs, DecoderForCausalLM
from tidal.rollout.models.loader import build_decoder, iter_checkpoint

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderArgs", "DecoderForCausalLM", "build_decoder", "iter_checkpoint"]
