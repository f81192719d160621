"""Gemma 2 (``model_type`` "gemma2"), and the Gemma pieces that Gemma 3 (``gemma3.py``) reuses.

What differs from ``layers.py``'s Llama shape (transformers' ``modeling_gemma2.py``):

- RMSNorm scales by ``1 + weight`` in float32 and rounds the product (``GemmaRMSNorm``);
- each layer normalises both sides of attention and of the MLP:
  ``h = h + post_attention_layernorm(attn(input_layernorm(h)))``, then
  ``h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``;
- embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype (``ScaledEmbedding``);
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``) and
  soft-capped, ``cap * tanh(scores / cap)`` (``attn_logit_softcapping``); the final logits likewise
  (``final_logit_softcapping``, ``SoftcappedHead``). Because of the latter the trainer may not compute
  log-probs from the hidden states in chunks (the registry marks Gemma not chunkable);
- layers alternate sliding-window and global attention (``layer_types``, read by
  ``layers.sliding_windows``); the MLP is gated ``gelu_pytorch_tanh`` (``hidden_activation``).

SDPA has no soft-capping, so soft-capped layers attend with explicit matmuls (``softcapped_attention``),
also at decode time on GPU (the Triton paged decode kernel has no soft-capping either). Weight names
and the q/k/v and gate/up packing are Llama's, so the generic loader applies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tidal.rollout.models.layers import Attention, CausalLM, DecoderArgs, GatedMLP, RMSNorm
from tidal.rollout.models.parallel import ParallelLMHead, TPGroup, VocabParallelEmbedding
from tidal.rollout.models.rope import apply_rope
from tidal.rollout.runner.attention import AttentionMetadata, store_kv


@dataclass
class GemmaArgs(DecoderArgs):
    """``DecoderArgs`` plus Gemma's attention scaling, soft-capping and per-layer attention kinds."""

    query_pre_attn_scalar: float = 1.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: tuple[str, ...] = ()


def gemma_args(config, attn_logit_softcapping: float | None) -> GemmaArgs:
    """Read a Gemma 2 / Gemma 3 text config; refuse what the engine does not implement."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"{config.model_type} with use_bidirectional_attention=True (an encoder) is not supported by the "
            "rollout engine, which generates causally"
        )
    return GemmaArgs.from_hf_config(
        config,
        hidden_act=getattr(config, "hidden_activation", None) or config.hidden_act,
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        attn_logit_softcapping=attn_logit_softcapping,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        layer_types=tuple(config.layer_types),
    )


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` (checkpoints store the offset from 1), in float32 like HF. On CUDA
    ``RMSNorm.forward`` runs it (and the residual add before it) as one ``triton_norm`` kernel."""

    weight_offset = 1.0

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps, scale_in_float32=True)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(VocabParallelEmbedding):
    """Embedding times ``sqrt(hidden_size)``; the factor is rounded to the weights' dtype first, as in HF
    (in bfloat16 sqrt(3072) = 55.43 becomes 55.5)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A Python float (already rounded): no device tensor to create, so CUDA-graph capture is safe.
        scale = float(torch.tensor(self.embedding_dim**0.5, dtype=self.weight.dtype))
        return super().forward(input_ids) * scale


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (identity when ``cap`` is None), in HF's order of operations."""
    return x if cap is None else torch.tanh(x / cap) * cap


class SoftcappedHead(ParallelLMHead):
    """The LM head followed by the final logit soft-capping (of the full, gathered logits)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup, cap: float | None):
        super().__init__(hidden_size, vocab_size, tp)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(super().forward(x), self.cap)


def _capped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager path: q [b, heads, q, d], k/v
    [b, kv_heads, k, d], mask [b, 1, q, k] (True = attend) -> [b, heads, q, d]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap)
    # A finite fill: a CUDA-graph padding row (nothing to attend) stays finite instead of NaN.
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def softcapped_attention(q, k, v, meta: AttentionMetadata, layer_idx: int, window, scale: float, cap: float):
    """``layers.paged_attention`` with soft-capped scores: store this step's k/v into the paged cache, then
    attend (prefill: the batch's own tokens, padded per sequence; decode: the gathered cache blocks)."""
    layer_cache = None if meta.kv_cache is None else meta.kv_cache[layer_idx]
    if layer_cache is not None:
        store_kv(layer_cache, k, v, meta.slot_mapping)
    if meta.is_prefill:
        qp, kp, vp = (x[meta.pad_index].transpose(1, 2) for x in (q, k, v))  # [batch, heads, len, d]
        out = _capped_attention(qp, kp, vp, meta.mask(window), scale, cap)
        return out.transpose(1, 2)[meta.pad_valid].reshape(q.shape[0], -1)
    batch, num_kv, head_dim = q.shape[0], layer_cache.shape[-2], layer_cache.shape[-1]
    blocks = layer_cache.flatten(2).index_select(1, meta.block_tables.view(-1))
    kv = blocks.view(2, batch, -1, num_kv, head_dim).transpose(2, 3)  # [2, batch, kv_heads, slots, d]
    out = _capped_attention(q[:, :, None, :], kv[0], kv[1], meta.mask(window), scale, cap)
    return out.reshape(batch, -1)


class GemmaAttention(Attention):
    """Llama attention scaled by ``query_pre_attn_scalar ** -0.5``, with optional score soft-capping."""

    def __init__(self, args: GemmaArgs, layer_idx: int):
        super().__init__(args, layer_idx)
        self.scale = args.query_pre_attn_scalar**-0.5
        self.cap = args.attn_logit_softcapping

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        if self.cap is None:
            return super().forward(x, cos, sin, meta)
        qkv = self.qkv_proj(x)
        qk = apply_rope(self.qk_heads(qkv), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.split[0] + self.split[1] :].view(-1, self.num_kv_heads, self.head_dim)
        out = softcapped_attention(q, k, v, meta, self.layer_idx, self.window, self.scale, self.cap)
        return self.o_proj(out)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after attention and the MLP. Keeps ``layers.DecoderLayer``'s contract: the returned
    ``(x, residual)`` sum to the hidden state (the final norm adds them)."""

    fp8_feeds = (
        ("input_layernorm", ("self_attn.qkv_proj",)),
        ("pre_feedforward_layernorm", ("mlp.gate_up_proj",)),
    )

    def __init__(self, args: GemmaArgs, layer_idx: int, attention_cls: type[Attention]):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = attention_cls(args, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GatedMLP(args)
        self.post_feedforward_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata):
        h = x if residual is None else residual + x
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, meta))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h


class GemmaCausalLM(CausalLM):
    """Gemma's model skeleton: scaled embeddings, Gemma norms, soft-capped head (subclasses pick the
    attention and how ``GemmaArgs`` are read)."""

    layer_cls = GemmaDecoderLayer

    def __init__(self, args: GemmaArgs):
        super().__init__(args)
        self.model.embed_tokens = ScaledEmbedding(args.vocab_size, args.hidden_size, args.tp)
        self.model.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = SoftcappedHead(
            args.hidden_size, args.vocab_size, args.tp, args.final_logit_softcapping
        )
        self.tie_weights()


class Gemma2ForCausalLM(GemmaCausalLM):
    attention_cls = GemmaAttention

    @classmethod
    def args_from_hf_config(cls, config) -> GemmaArgs:
        return gemma_args(config, getattr(config, "attn_logit_softcapping", None))
