"""Gemma 4's paged attention: layers of different KV shapes in one cache, and layers that read another's.

Gemma 4 layers differ in their KV shapes: the sliding-window layers have ``head_dim`` wide heads, the
full-attention ones ``global_head_dim`` wide heads (and, with ``attention_k_eq_v``, their own head count).
The engine's paged cache is one tensor with one row shape for every layer, so ``Gemma4Args`` declares a
row of ``max(kv_heads * head_dim)`` elements (``kv_cache_layout``) and each layer views the first
``kv_heads * head_dim`` of them as its own ``[kv_heads, head_dim]`` (``layer_view``). When a layer's
row is shorter than the cache's, its view is strided (not contiguous): it is stored and read with
the torch ops below, which gather only the step's blocks; a full-row view takes the engine's usual
paths (``layers.paged_attention``: the Triton kernels on CUDA, for heads up to 256 wide).

KV sharing: the last ``num_kv_shared_layers`` layers compute no keys/values; each reads those of the last
earlier layer of its attention type (``Gemma4Args.kv_sources``). They have no slot in the cache: at
prefill they take the producer's fresh keys/values of the step, otherwise the producer's cache.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tidal.rollout.models.layers import paged_attention
from tidal.rollout.runner.attention import AttentionMetadata, prefill_attention

# The widest head the Triton paged kernels take (``triton_context.supports``); Gemma 4's 512-wide global
# heads attend through the torch ops instead.
TRITON_HEAD_DIM = 256


def layer_view(kv_cache: torch.Tensor | None, kv_index: int, kv_heads: int, head_dim: int):
    """Layer ``kv_index``'s cache as [2, blocks, block_size, kv_heads, head_dim] (None without a cache)."""
    if kv_cache is None:
        return None
    rows = kv_cache[kv_index].flatten(-2)  # [2, blocks, block_size, row]
    return rows[..., : kv_heads * head_dim].unflatten(-1, (kv_heads, head_dim))


def _store(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``attention.store_kv`` for a strided view: blocks and slots merge without a copy, heads do not."""
    slots = layer_cache.flatten(1, 2)  # [2, slots, kv_heads, head_dim], a view
    slots[0].index_copy_(0, slot_mapping, k)
    slots[1].index_copy_(0, slot_mapping, v)


def _gather(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The step's blocks of a strided view: [2, batch, kv_heads, slots, head_dim] (only these are copied)."""
    batch = block_tables.shape[0]
    blocks = layer_cache.index_select(1, block_tables.reshape(-1))  # [2, batch * max_blocks, bs, h, d]
    kv = blocks.reshape(2, batch, -1, *layer_cache.shape[-2:])
    return kv.transpose(2, 3)


def _strided_attention(q, k, v, meta: AttentionMetadata, layer_cache, window, scale: float) -> torch.Tensor:
    """Attention over a strided cache view, the torch paths of ``attention.py``: q [tokens, heads, d]."""
    if meta.is_prefill and meta.block_tables is None:  # the step's own keys, nothing cached is read
        return prefill_attention(q, k, v, meta, window, scale)
    kv = _gather(layer_cache, meta.block_tables)
    if meta.is_prefill:  # prefill with context: the queries padded per sequence
        qp = q[meta.pad_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qp, kv[0], kv[1], attn_mask=meta.mask(window), scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)[meta.pad_valid].reshape(q.shape[0], -1)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], kv[0], kv[1], attn_mask=meta.mask(window), scale=scale, enable_gqa=True
    )
    return out.reshape(q.shape[0], -1)


def gemma4_attention(
    q, k, v, meta: AttentionMetadata, kv_index: int, window, scale: float, store: bool
) -> torch.Tensor:
    """Store k/v into layer ``kv_index``'s slice of the cache (unless ``store`` is False: a KV-shared layer
    passes its producer's keys/values, already stored), then attend. q [tokens, heads, d], k/v
    [tokens, kv_heads, d] -> [tokens, heads * d]."""
    if meta.kv_cache is None:
        return prefill_attention(q, k, v, meta, window, scale)
    heads, head_dim = k.shape[1:]
    full_row = heads * head_dim == meta.kv_cache.shape[-2] * meta.kv_cache.shape[-1]
    if full_row and (meta.backend != "triton" or head_dim <= TRITON_HEAD_DIM):
        # A full row: the whole cache reshaped to this layer's heads is a view, and the engine's usual
        # paths (Triton on CUDA) read it. The copy of ``meta`` shares the step's masks.
        full = copy.copy(meta)
        full.kv_cache = meta.kv_cache.view(*meta.kv_cache.shape[:4], heads, head_dim)
        return paged_attention(q, k, v, full, kv_index, window, scale, stored=not store)
    layer_cache = layer_view(meta.kv_cache, kv_index, heads, head_dim)
    if store:
        _store(layer_cache, k, v, meta.slot_mapping)
    return _strided_attention(q, k, v, meta, layer_cache, window, scale)
