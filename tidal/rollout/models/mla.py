"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

MLA caches no per-head keys or values. Per token and layer the cache holds one row of
``kv_lora_rank + qk_rope_head_dim`` values: the compressed latent ``c`` (``kv_a_proj_with_mqa``'s first
``kv_lora_rank`` outputs after ``kv_a_layernorm``) and the rope key ``k_rot`` that every head shares (its
last ``qk_rope_head_dim`` outputs, after RoPE). ``kv_b_proj`` holds, per head h, the up-projections of
the latent: ``W_UK[h]`` (``qk_nope_head_dim`` rows) and ``W_UV[h]`` (``v_head_dim`` rows), so that head h
attends with keys ``[W_UK[h] c, k_rot]`` and values ``W_UV[h] c`` (transformers' ``DeepseekV3Attention``).

Two ways to compute the same attention:

- a prefill over the batch's own tokens expands the latents to per-head keys and values, as
  transformers does, for one attention call (``attention.prefill_attention``: a padded SDPA call where
  the query/key head dim differs from the value one, as in DeepSeek-V3, else flash varlen on CUDA);
- anything that reads the cache (decode, and a prefill with context: prefix caching, chunked prefill)
  attends in latent space, the standard MLA decode: ``W_UK`` is absorbed into the query
  (``q_lat[h] = W_UK[h]^T q_nope[h]``, so ``q_lat[h] . c = q_nope[h] . W_UK[h] c``), the cached rows are
  the keys of one shared head (multi-query attention with scores ``q_lat . c + q_rot . k_rot``) and
  their first ``kv_lora_rank`` values the values; ``W_UV`` is applied to the attended latent afterwards.

Both run in torch (the Triton paged kernels take per-head K/V pages, not latent rows): on CUDA too, and
a decode step stays capturable in a CUDA graph (fixed shapes, no host sync).

The cache layout (``MLAShape.cache_layout``: one tensor, one "head" of the latent row) is what the family's
``DecoderArgs`` declare as ``kv_cache_layout``; ``ModelRunner`` allocates the cache from it.

DeepSeek lays the rope dimensions out in interleaved pairs when ``rope_interleave`` is set; those are
gathered into the rotate-half layout (evens, then odds) before RoPE, which is transformers'
``apply_rotary_pos_emb_interleave`` exactly. The softmax scale is ``qk_head_dim ** -0.5``, times
``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling (``softmax_scale``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.rollout.models.layers import RMSNorm
from tidal.rollout.models.rope import apply_rope, rope_parameters
from tidal.rollout.runner.attention import AttentionMetadata, prefill_attention

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAShape:
    """The attention fields of a DeepSeek-V2/V3 config (``q_lora_rank`` None: a plain ``q_proj``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cached row per token: the normalised latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        """(tensors, heads, dim) per layer and slot, as ``ModelRunner`` reads ``kv_cache_layout``."""
        return (1, 1, self.latent_dim)

    @classmethod
    def from_hf_config(cls, config) -> MLAShape:
        return cls(
            q_lora_rank=getattr(config, "q_lora_rank", None),
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            rope_interleave=bool(getattr(config, "rope_interleave", False)),
            softmax_scale=softmax_scale(config, config.qk_nope_head_dim + config.qk_rope_head_dim),
        )


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term, ``0.1 * mscale * ln(factor) + 1`` (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``; a scaled RoPE with ``mscale_all_dim`` multiplies it by
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` (DeepSeek's YaRN configs)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= yarn_mscale(params["factor"], mscale_all_dim) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the rotate-half layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def store_latent(layer_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the step's latent rows [tokens, latent_dim] into their slots of ``layer_cache``
    ([1, blocks, block_size, 1, latent_dim])."""
    layer_cache.view(-1, rows.shape[-1]).index_copy_(0, slot_mapping, rows)


def gather_latents(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Every slot of each row's blocks (the block-table width, padding included; masked by the caller):
    [batch, 1, max_blocks * block_size, latent_dim], the keys of one shared head."""
    batch = block_tables.shape[0]
    blocks = layer_cache[0].index_select(0, block_tables.reshape(-1).long())
    return blocks.view(batch, 1, -1, layer_cache.shape[-1])


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 attention (parameter names as transformers'); x [tokens, hidden] -> [tokens, hidden].

    The engine builds it from a ``DecoderArgs`` whose ``mla`` is an ``MLAShape`` (single device: the
    family refuses tensor parallelism)."""

    def __init__(self, args, layer_idx: int):
        super().__init__()
        shape: MLAShape = args.mla
        self.shape = shape
        self.layer_idx = layer_idx
        self.num_heads = args.num_heads
        hidden, q_out = args.hidden_size, args.num_heads * shape.qk_head_dim
        if shape.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, shape.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(shape.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, shape.latent_dim, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(shape.kv_lora_rank, LATENT_NORM_EPS)
        per_head = shape.qk_nope_head_dim + shape.v_head_dim
        self.kv_b_proj = nn.Linear(shape.kv_lora_rank, args.num_heads * per_head, bias=False)
        self.o_proj = nn.Linear(args.num_heads * shape.v_head_dim, hidden, bias=args.o_bias)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, qk_head_dim], before RoPE."""
        if self.shape.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.shape.qk_head_dim)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        s = self.shape
        q_nope, q_rot = self.queries(x).split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        rot = torch.cat([q_rot, k_rot[:, None, :]], dim=1)  # rotate q and the shared k together
        if s.rope_interleave:
            rot = deinterleave(rot)
        rot = apply_rope(rot, cos, sin)
        q_rot, k_rot = rot[:, : self.num_heads], rot[:, self.num_heads]
        layer_cache = None if meta.kv_cache is None else meta.kv_cache[self.layer_idx]
        if layer_cache is not None:
            store_latent(layer_cache, torch.cat([latent, k_rot], dim=-1), meta.slot_mapping)
        if meta.exact:  # the family is not in batch_invariant's EXACT_MODEL_TYPES: never reached
            raise ValueError("exact_logprobs does not support multi-head latent attention")
        if meta.is_prefill and meta.block_tables is None:
            out = self._expanded_prefill(q_nope, q_rot, latent, k_rot, meta)
        else:
            out = self._latent_attention(q_nope, q_rot, layer_cache, meta)
        return self.o_proj(out)

    def _expanded_prefill(self, q_nope, q_rot, latent, k_rot, meta: AttentionMetadata) -> torch.Tensor:
        """The batch's own tokens, with per-head keys and values expanded from the latents."""
        s = self.shape
        kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, -1)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        return prefill_attention(q, k, v, meta, None, s.softmax_scale)

    def _latent_attention(self, q_nope, q_rot, layer_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Queries against the cached latents of their sequences (decode: one query per row; a prefill
        with context: each sequence's new tokens, padded as in prefill), ``W_UK`` absorbed into q."""
        s = self.shape
        w = self.kv_b_proj.weight.view(self.num_heads, -1, s.kv_lora_rank)
        w_uk, w_uv = w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]
        q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot], dim=-1)
        keys = gather_latents(layer_cache, meta.block_tables)
        values = keys[..., : s.kv_lora_rank]
        mask = meta.mask(None)
        if meta.is_prefill:
            qp = q[meta.pad_index].transpose(1, 2)  # [batch, heads, len, latent_dim]
            out = F.scaled_dot_product_attention(
                qp, keys, values, attn_mask=mask, scale=s.softmax_scale, enable_gqa=True
            )
            out = out.transpose(1, 2)[meta.pad_valid]  # [tokens, heads, kv_lora_rank]
        else:
            out = F.scaled_dot_product_attention(
                q[:, :, None], keys, values, attn_mask=mask, scale=s.softmax_scale, enable_gqa=True
            )[:, :, 0]
        return torch.einsum("thr,hvr->thv", out, w_uv).reshape(out.shape[0], -1)
