"""Qwen3: Llama with an RMSNorm over each q and k head (weights of ``head_dim``) before RoPE.

Its q/k/v bias follows ``attention_bias`` like Llama's (Qwen2's always-on bias is gone).
"""

from __future__ import annotations

import torch

from tidal.rollout.models.layers import Attention, CausalLM, DecoderArgs, RMSNorm, fusable_head_norm


class Qwen3Attention(Attention):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        qk = super().qk_heads(qkv)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)

    def fused_qk_heads(self, qkv: torch.Tensor):
        # The fused RoPE kernel applies the per-head norms itself (as triton_norm computes them) where it
        # can do so bit-equally; otherwise the norms run here, unfused.
        if not fusable_head_norm(self.head_dim):
            return self.qk_heads(qkv), None
        return super().qk_heads(qkv), (self.q_norm, self.k_norm)


class Qwen3ForCausalLM(CausalLM):
    attention_cls = Qwen3Attention
