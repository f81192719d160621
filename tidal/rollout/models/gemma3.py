"""Gemma 3 text models (``model_type`` "gemma3_text"): Gemma 2 (``gemma2.py``) with q/k norms and two RoPEs.

What differs from Gemma 2 (transformers' ``modeling_gemma3.py``, ``Gemma3ForCausalLM``):

- ``q_norm`` / ``k_norm``: a Gemma RMSNorm (``1 + weight``) over each q and k head before RoPE;
- RoPE per layer kind: ``rope_parameters`` holds one entry for "sliding_attention" layers (local base,
  10k) and one for "full_attention" layers (global base, 1M, possibly scaled, e.g. linear x8), so the
  model keeps two cos/sin tables and each attention reads its own;
- no attention soft-capping (HF reads ``attn_logit_softcapping`` but never applies it; neither do we);
  the final logits are soft-capped when ``final_logit_softcapping`` is set (it is None in released
  checkpoints, but the registry still marks the head not chunkable);
- the default layer pattern is five sliding-window layers, then one global (``layer_types``).

Only the text-only checkpoints load here; the multimodal ``gemma3`` wrapper (vision tower,
``language_model.*`` weight names) is a different ``model_type``.
"""

from __future__ import annotations

import torch

from tidal.rollout.models.gemma2 import GemmaArgs, GemmaAttention, GemmaCausalLM, GemmaRMSNorm, gemma_args
from tidal.rollout.models.layers import Rotary
from tidal.rollout.models.rope import SUPPORTED_ROPE_TYPES, rope_table
from tidal.rollout.runner.attention import AttentionMetadata

# Index of each layer kind's RoPE in the (cos, sin) tuples that ``Gemma3ForCausalLM.rope`` returns.
ROPE_SLOTS = {"sliding_attention": 0, "full_attention": 1}


def layer_type_inv_freq(config, layer_type: str, head_dim: int, max_model_len: int):
    """Inverse frequencies and cos/sin scale of one layer kind's RoPE (``rope_parameters[layer_type]``)."""
    params = config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r} for {layer_type} layers; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the rollout decoder")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"seq_len": max_model_len} if rope_type == "dynamic" else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](
        config, torch.device("cpu"), layer_type=layer_type, **kwargs
    )
    return inv_freq.float(), float(scale)


class Gemma3Attention(GemmaAttention):
    def __init__(self, args: GemmaArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.rope_slot = ROPE_SLOTS[args.layer_types[layer_idx]]
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        qk = super().qk_heads(qkv)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        return super().forward(x, cos[self.rope_slot], sin[self.rope_slot], meta)


class Gemma3ForCausalLM(GemmaCausalLM):
    attention_cls = Gemma3Attention

    def __init__(self, args: GemmaArgs):
        super().__init__(args)
        self.rotary_local = Rotary()  # sliding-window layers; ``self.rotary`` serves the global ones

    @classmethod
    def args_from_hf_config(cls, config) -> GemmaArgs:
        unknown = sorted(set(config.layer_types) - set(ROPE_SLOTS))
        if unknown:
            raise ValueError(
                f"unsupported gemma3_text layer_types {unknown}; supported: {sorted(ROPE_SLOTS)}"
            )
        return gemma_args(config, attn_logit_softcapping=None)

    def init_rope(self, hf_config, max_model_len: int) -> None:
        device = self.model.embed_tokens.weight.device
        for rotary, layer_type in ((self.rotary_local, "sliding_attention"), (self.rotary, "full_attention")):
            inv_freq, scale = layer_type_inv_freq(hf_config, layer_type, self.args.head_dim, max_model_len)
            cos, sin = rope_table(inv_freq, scale, max_model_len)
            rotary.cos, rotary.sin = cos.to(device), sin.to(device)

    def rope(self, positions, meta: AttentionMetadata, dtype: torch.dtype):
        (cos_local, sin_local), (cos, sin) = (
            self.rotary_local(positions, dtype),
            self.rotary(positions, dtype),
        )
        return (cos_local, cos), (sin_local, sin)
