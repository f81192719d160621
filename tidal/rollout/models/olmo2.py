"""OLMo-2 (``model_type`` "olmo2"): Llama with post-norm layers and q/k norms over whole projections.

What differs from ``layers.py``'s Llama shape (transformers' ``modeling_olmo2.py``):

- a layer has no input norm; it normalises the *outputs* of attention and MLP before adding them to the
  residual stream: ``h = h + post_attention_layernorm(attn(h))``, ``h = h + post_feedforward_layernorm(mlp(h))``;
- ``q_norm`` / ``k_norm`` are RMSNorms over the full q (heads x head_dim) and k (kv_heads x head_dim)
  projections, applied before the split into heads and RoPE;
- every RMSNorm scales by its weight in float32 and rounds the product (``scale_in_float32``).

Under tensor parallelism each rank holds some of the heads, so ``q_norm`` / ``k_norm`` (``ShardedRMSNorm``)
all-reduce the sum of squares to normalise over the whole projection (a KV head replicated on several ranks
is counted once).

Weight names, the q/k/v and gate/up packing, ``attention_bias`` (q/k/v and o) and the bias-free MLP are
Llama's, so the generic loader applies unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.rollout.models.layers import Attention, CausalLM, DecoderArgs, GatedMLP, RMSNorm
from tidal.rollout.models.parallel import Rows, TPGroup, head_rows
from tidal.rollout.runner.attention import AttentionMetadata


class ShardedRMSNorm(RMSNorm):
    """An RMSNorm (float32 scaling) over a dimension whose rows ``rows`` this rank holds, ``replicas``
    ranks holding each; the mean square is over the full dimension. Size 1: the plain norm."""

    def __init__(self, rows: Rows, eps: float, tp: TPGroup, replicas: int):
        super().__init__(rows.size, eps, scale_in_float32=True)
        self.rows, self.tp, self.replicas = rows, tp, replicas

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.tp.size == 1:
            return super().forward(x, residual)
        x32 = x.float()
        square_sum = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.replicas
        x32 = x32 * torch.rsqrt(square_sum / self.rows.full + self.eps)
        return (self.weight * x32).to(x.dtype)

    def take(self, param: torch.Tensor, kind: str, part: int | None, tensor: torch.Tensor, name: str):
        if tuple(tensor.shape) != (self.rows.full,):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {(self.rows.full,)}")
        return param, self.rows.take(tensor, 0)


class Olmo2Attention(Attention):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        tp = args.tp
        q_rows, kv_rows = head_rows(args.num_heads, args.num_kv_heads, args.head_dim, tp)
        kv_replicas = max(1, tp.size // args.num_kv_heads)  # ranks sharing each KV head
        self.q_norm = ShardedRMSNorm(q_rows, args.rms_norm_eps, tp, replicas=1)
        self.k_norm = ShardedRMSNorm(kv_rows, args.rms_norm_eps, tp, replicas=kv_replicas)

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

    def __init__(self, args: DecoderArgs):
        super().__init__(args)
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, scale_in_float32=True)
