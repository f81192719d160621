"""Phi-3 (``model_type`` "phi3"): Llama with fused checkpoint projections and LongRoPE.

What differs from ``layers.py``'s Llama shape (transformers' ``modeling_phi3.py``):

- the checkpoint already stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (q, k, v
  and gate, up in our packing order), so those tensors load into our packed parameters as they are
  (``packed_params`` is empty: nothing to stack);
- ``rope_parameters`` of type "longrope" (the 128k-context models): two sets of per-frequency factors,
  ``short_factor`` and ``long_factor``, and one attention factor scaling cos/sin. transformers picks the
  set per forward from the sequence length: short while ``max position + 1 <= original_max_position_
  embeddings``, long beyond. The engine applies that rule per token: a prefill token uses the long set
  when its sequence's prompt is longer than ``original_max_position_embeddings``, a decode token when its
  own position is at or past it. So sequences that stay within the original length, and prompts that
  start past it, match ``transformers.generate`` exactly. A sequence that *crosses* the boundary while
  decoding matches HF's forward with its KV cache (keys already cached keep the short rotation), not
  ``generate``: Phi-3's ``prepare_inputs_for_generation`` drops the cache at the crossing and recomputes
  the whole sequence with the long set, which this paged engine does not do.

Other RoPE types and the optional sliding window (over every layer) are the generic ones.
"""

from __future__ import annotations

import torch

from tidal.rollout.models.layers import CausalLM, DecoderArgs, Rotary
from tidal.rollout.models.rope import rope_parameters, rope_table
from tidal.rollout.runner.attention import AttentionMetadata


def longrope_tables(hf_config, max_model_len: int):
    """(short, long) pairs of (cos, sin) tables [max_model_len, head_dim], per transformers' longrope init."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_parameters(hf_config).get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the rollout decoder")
    init = ROPE_INIT_FUNCTIONS["longrope"]
    cpu = torch.device("cpu")
    short_freq, short_scale = init(hf_config, cpu)
    original = original_max_positions(hf_config)
    long_freq, long_scale = init(hf_config, cpu, seq_len=original + 1)
    return rope_table(short_freq, short_scale, max_model_len), rope_table(
        long_freq, long_scale, max_model_len
    )


def original_max_positions(hf_config) -> int:
    return int(rope_parameters(hf_config)["original_max_position_embeddings"])


def long_rope_tokens(positions: torch.Tensor, meta: AttentionMetadata, original: int) -> torch.Tensor:
    """Which tokens take the long factors (bool [tokens]): transformers' choice for a forward over a
    sequence, whose length is its last position + 1 (see the module docstring)."""
    if not meta.is_prefill:
        return positions >= original
    padded = positions[meta.pad_index].masked_fill(~meta.pad_valid, 0)  # [batch, max_len]
    last = padded.amax(dim=1)  # each sequence's last position
    return last[meta.token_seq] >= original


class Phi3ForCausalLM(CausalLM):
    packed_params = {}  # the checkpoint's qkv_proj / gate_up_proj are already packed

    def __init__(self, args: DecoderArgs):
        super().__init__(args)
        self.rotary_long = Rotary()  # LongRoPE's long-factor tables (unset for other RoPE types)
        self.longrope_original: int | None = None

    def init_rope(self, hf_config, max_model_len: int) -> None:
        if rope_parameters(hf_config)["rope_type"] != "longrope":
            self.longrope_original = None
            return super().init_rope(hf_config, max_model_len)
        device = self.model.embed_tokens.weight.device
        (cos, sin), (cos_long, sin_long) = longrope_tables(hf_config, max_model_len)
        self.rotary.cos, self.rotary.sin = cos.to(device), sin.to(device)
        self.rotary_long.cos, self.rotary_long.sin = cos_long.to(device), sin_long.to(device)
        self.longrope_original = original_max_positions(hf_config)

    def rope(self, positions, meta: AttentionMetadata, dtype: torch.dtype):
        cos, sin = self.rotary(positions, dtype)
        if self.longrope_original is None:
            return cos, sin
        cos_long, sin_long = self.rotary_long(positions, dtype)
        long = long_rope_tokens(positions, meta, self.longrope_original)[:, None]
        return torch.where(long, cos_long, cos), torch.where(long, sin_long, sin)
