"""Paged attention with learned per-head sinks (gpt-oss), in plain PyTorch.

A sink is one extra logit per query head in the softmax denominator, with no value:
``softmax([scores, sink])[:-1] @ V``, so a head may put weight on "nothing" (transformers'
``modeling_gpt_oss.eager_attention_forward``). SDPA has no such term, so we give it one key more: the
head dim is padded by ``_PAD`` zero columns (queries, keys and values alike), each query gets
``sink / scale`` in its first padded column, and one extra key (``e_d``: 1 in that column, 0 elsewhere)
with a zero value is appended, unmasked. Its score is then exactly ``sink``, the real keys' scores are
unchanged, and one fused SDPA call computes the sink softmax without a score tensor of our own.
The sink key is shared by the query heads of a KV group (the per-head part lives in the query), so GQA
stays SDPA's ``enable_gqa``.

The three paths are ``runner/attention.py``'s, reading the same ``AttentionMetadata``: prefill (the batch's own
keys, right-padded per sequence), decode and prefill with context (keys gathered from the paged cache
through the block tables; on the Triton backend the paged kernels, which scale their output by
``sink_share`` of the keys' log-sum-exp, ``e^lse / (e^lse + e^sink)``, the same softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.rollout.runner.attention import AttentionMetadata, store_kv

_PAD = 8  # padded head-dim columns: keeps the head dim a multiple of 8 for SDPA's fused kernels


def sink_sdpa(q, k, v, mask: torch.Tensor, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """q [b, heads, q, d], k/v [b, kv_heads, k, d], mask [b, 1, q, k] (True = attend), sinks [heads] ->
    [b, heads, q, d]: softmax over the scores and the head's sink, without the sink's (zero) value."""
    b, heads, nq, d = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    sink_col = (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(b, heads, nq, 1)
    q = torch.cat([q, sink_col, q.new_zeros(b, heads, nq, _PAD - 1)], dim=-1)
    sink_key = k.new_zeros(b, kv_heads, 1, d + _PAD)
    sink_key[..., d] = 1.0
    k = torch.cat([torch.cat([k, k.new_zeros(b, kv_heads, nk, _PAD)], dim=-1), sink_key], dim=2)
    # v padded alike (zeros), so SDPA's kernels that want equal q/k/v head dims apply; sliced off below.
    v = torch.cat(
        [torch.cat([v, v.new_zeros(b, kv_heads, nk, _PAD)], dim=-1), k.new_zeros(b, kv_heads, 1, d + _PAD)],
        dim=2,
    )
    mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[..., :d]


def sink_paged_attention(
    q, k, v, meta: AttentionMetadata, layer_idx: int, window, scale, sinks, stored: bool = False
):
    """Store this step's k/v into the layer's paged cache (unless ``stored``: a fused kernel did), then
    attend with sinks. q [tokens, heads, d], k/v [tokens, kv_heads, d] -> [tokens, heads * d] (decode:
    one token per sequence).

    On the Triton backend, decode and prefill with context run the paged kernels with their ``sinks``
    argument (``triton_attention`` / ``triton_context``); plain prefill is SDPA on every backend."""
    layer_cache = None if meta.kv_cache is None else meta.kv_cache[layer_idx]
    if layer_cache is not None and not stored:
        store_kv(layer_cache, k, v, meta.slot_mapping)
    if meta.is_prefill and meta.block_tables is None:  # the batch's own keys
        qp, kp, vp = (x[meta.pad_index].transpose(1, 2) for x in (q, k, v))  # [batch, heads, len, d]
        out = sink_sdpa(qp, kp, vp, meta.mask(window), scale, sinks)
        return out.transpose(1, 2)[meta.pad_valid].reshape(q.shape[0], -1)
    if meta.backend == "triton":
        out = _triton_sink_attention(q, layer_cache, meta, window, scale, sinks)
        if out is not None:
            return out
    return torch_sink_attention(q, layer_cache, meta, window, scale, sinks)


def torch_sink_attention(q, layer_cache: torch.Tensor, meta: AttentionMetadata, window, scale, sinks):
    """Decode or prefill with context over the gathered cache blocks: one ``sink_sdpa`` call."""
    batch, num_kv, head_dim = meta.block_tables.shape[0], layer_cache.shape[-2], layer_cache.shape[-1]
    blocks = layer_cache.flatten(2).index_select(1, meta.block_tables.view(-1))
    kv = blocks.view(2, batch, -1, num_kv, head_dim).transpose(2, 3)  # [2, batch, kv_heads, slots, d]
    mask = meta.mask(window)
    if meta.is_prefill:  # prefill with context: queries [start, end) against the cached [0, end)
        out = sink_sdpa(q[meta.pad_index].transpose(1, 2), kv[0], kv[1], mask, scale, sinks)
        return out.transpose(1, 2)[meta.pad_valid].reshape(q.shape[0], -1)
    out = sink_sdpa(q[:, :, None, :], kv[0], kv[1], mask, scale, sinks)
    return out.reshape(batch, -1)


def _triton_sink_attention(q, layer_cache, meta: AttentionMetadata, window, scale, sinks):
    """The paged Triton kernels with sinks, or None where they do not apply (``runner/attention.py``'s rules)."""
    from tidal.rollout.runner import attention

    if not meta.is_prefill:
        from tidal.rollout.kernels.triton_attention import paged_decode_attention

        return paged_decode_attention(
            q, layer_cache, meta.block_tables, meta.context_lens, window, scale, sinks=sinks
        )
    from tidal.rollout.kernels import triton_context

    if not (attention.CONTEXT_KERNEL and triton_context.supports(q.shape[-1])):
        return None
    return attention.context_kernel_attention(q, layer_cache, meta, window, scale, sinks=sinks)
