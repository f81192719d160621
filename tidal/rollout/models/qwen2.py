"""Qwen2: Llama with a bias on the q/k/v projections (always, whatever ``attention_bias`` says) and
per-layer sliding windows from ``layer_types`` / ``use_sliding_window`` (read by ``layers.sliding_windows``).
"""

from __future__ import annotations

from tidal.rollout.models.layers import CausalLM, DecoderArgs


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def args_from_hf_config(cls, config) -> DecoderArgs:
        return DecoderArgs.from_hf_config(config, qkv_bias=True)
