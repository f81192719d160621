"""OLMo-2 (``model_type`` "olmo2"): Llama with post-norm layers and q/k norms over whole projections.

What differs from ``layers.py``'s Llama shape (transformers' ``modeling_olmo2.py``):

- a layer has no input norm; it normalises the *outputs* of attention and MLP before adding them to the
  residual stream: ``h = h + post_attention_layernorm(attn(h))``, ``h = h + post_feedforward_layernorm(mlp(h))``;
- ``q_norm`` / ``k_norm`` are RMSNorms over the full q (heads x head_dim) and k (kv_heads x head_dim)
  projections, applied before the split into heads and RoPE;
- every RMSNorm scales by its weight in float32 and rounds the product (``scale_in_float32``).

Weight names, the q/k/v and gate/up packing, ``attention_bias`` (q/k/v and o) and the bias-free MLP are
Llama's, so the generic loader applies unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.rollout.attention import AttentionMetadata
from tidal.rollout.models.layers import Attention, CausalLM, DecoderArgs, GatedMLP, RMSNorm


class Olmo2Attention(Attention):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.q_norm = RMSNorm(args.q_size, args.rms_norm_eps, scale_in_float32=True)
        self.k_norm = RMSNorm(args.kv_size, args.rms_norm_eps, scale_in_float32=True)

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        q_end, k_end = self.split[0], self.split[0] + self.split[1]
        q, k = self.q_norm(qkv[:, :q_end]), self.k_norm(qkv[:, q_end:k_end])
        return torch.cat((q, k), dim=-1).view(-1, self.num_heads + self.num_kv_heads, self.head_dim)


class Olmo2DecoderLayer(nn.Module):
    """Post-norm layer. Keeps ``layers.DecoderLayer``'s contract: the returned ``(x, residual)`` sum to the
    hidden state (the final norm adds them), so it chains with the base model's forward."""

    def __init__(self, args: DecoderArgs, layer_idx: int, attention_cls: type[Attention]):
        super().__init__()
        self.self_attn = attention_cls(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_float32=True)
        self.mlp = GatedMLP(args)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_float32=True)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata):
        h = x if residual is None else residual + x
        h = h + self.post_attention_layernorm(self.self_attn(h, cos, sin, meta))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(CausalLM):
    attention_cls = Olmo2Attention
    layer_cls = Olmo2DecoderLayer
    supports_tp = False  # q_norm / k_norm span every head: a sharded norm needs a cross-rank reduction

    def __init__(self, args: DecoderArgs):
        super().__init__(args)
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_float32=True)
