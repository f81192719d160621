"""Prefill-with-context attention as a Triton kernel (GPU only; imported lazily by ``runner/attention.py``).

With prefix caching or chunked prefill, a prefill computes each sequence's new tokens ``[start, end)``
against keys/values ``[0, end)`` that sit in the paged cache (the cached prefix plus the tokens just
stored). The torch path gathers every sequence's blocks into a padded copy and builds a dense mask; this
kernel reads the pages in place through the block table and keeps an online softmax over ``BLOCK_N``-key
chunks, so neither the copy nor the mask exists and no sequence is padded to the longest.

Work split: one program per (sequence, row tile, kv head). A sequence's query rows are its
(token, head-of-the-group) pairs flattened, token-major: ``row = token * GROUP + g``. A tile of
``BLOCK_M`` rows is one ``tl.dot`` operand, so every K/V byte a tile reads serves all query heads of the
GQA group, and a group of 7 heads (Qwen2.5's 14/2) wastes nothing on padding to a power of two. Each
program walks keys from 0 (or the first key its window allows) up to its last row's position: causal
masking inside, and the launch grid is ``(batch, cdiv(max new tokens * GROUP, BLOCK_M), kv heads)``;
tiles past a shorter sequence's rows exit at once. Everything the kernel reads (block tables, starts,
ends) stays on the device: no host sync.

Split-K: when those programs are too few to fill the GPU (a long prompt's chunk: one sequence, a few
hundred new tokens over a 16k context), each tile's key range is cut into ``num_splits`` pieces (the
third grid axis is kv head x split) whose partial results (normalised output + log-sum-exp) the decode
kernel's merge (``triton_attention.merge_splits``) combines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.accel import sm_count
from tidal.rollout.kernels.triton_attention import (
    choose_num_splits,
    merge_splits,
    scale_halves,
    sink_share,
    split_buffers,
)

LOG2E = 1.4426950408889634


@triton.jit
def _attend_chunk(
    q,
    m,
    denom,
    acc,
    t0,
    hi,
    pos,
    window,
    bt_row,
    k_base,
    v_base,
    ks_base,
    vs_base,
    d,
    stride_kblk,
    stride_kslot,
    stride_sblk,
    stride_sslot,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
):
    """One online-softmax step over keys ``[t0, t0 + BLOCK_N)`` (those ``>= hi`` are never read):
    returns the updated (running max, denominator, accumulator). ``MASKED``: apply the causal (and window)
    mask; without it every key of the chunk must be visible to every row. ``FP8``: the cache holds e4m3
    rows whose scales (``ks_base``/``vs_base``) multiply the logits and the probabilities."""
    offs = t0 + tl.arange(0, BLOCK_N)
    in_range = offs < hi
    page = tl.load(bt_row + offs // BLOCK_SIZE, mask=in_range, other=0)
    kv_off = page.to(tl.int64) * stride_kblk + (offs % BLOCK_SIZE) * stride_kslot
    k = tl.load(k_base + kv_off[:, None] + d[None, :], mask=in_range[:, None], other=0.0).to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s_off = page.to(tl.int64) * stride_sblk + (offs % BLOCK_SIZE) * stride_sslot  # FP8 only
    if FP8:
        s = s * tl.load(ks_base + s_off, mask=in_range, other=0.0)[None, :]
    s = s * qk_scale  # base-2 logits
    if MASKED:
        visible = (offs[None, :] <= pos[:, None]) & in_range[None, :]
        if HAS_WINDOW:
            visible = visible & (offs[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row whose window starts after this chunk has seen nothing yet (m_new = -inf): subtract 0
        # instead, so its alpha and p are exp2(-inf) = 0 rather than NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        m_sub = m_new
    alpha = tl.math.exp2(m - m_sub)
    p = tl.math.exp2(s - m_sub[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    v = tl.load(v_base + kv_off[:, None] + d[None, :], mask=in_range[:, None], other=0.0).to(q.dtype)
    p_v = p
    if FP8:
        p_v = p * tl.load(vs_base + s_off, mask=in_range, other=0.0)[None, :]
    if IEEE:
        pv = tl.dot(p_v.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p_v.to(v.dtype), v)
    return m_new, denom, acc * alpha[:, None] + pv


@triton.jit
def _context_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    sink_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    q_first_ptr,
    starts_ptr,
    ends_ptr,
    stride_first,
    stride_qt,
    stride_qh,
    stride_kblk,
    stride_kslot,
    stride_khead,
    stride_sblk,
    stride_sslot,
    stride_btb,
    stride_ot,
    stride_oh,
    qk_scale,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    # int32 positions (index math per key stays 32-bit; positions are far below 2^31)
    start = tl.load(starts_ptr + b).to(tl.int32)
    end = tl.load(ends_ptr + b).to(tl.int32)
    num_rows = (end - start) * GROUP
    row0 = tile * BLOCK_M
    if row0 < num_rows:
        rows = row0 + tl.arange(0, BLOCK_M)
        live_row = rows < num_rows
        # A row past the sequence's last one repeats it (never stored): every row has a key to attend.
        token = tl.minimum(rows, num_rows - 1) // GROUP
        head = kvh * GROUP + rows % GROUP
        pos = start + token  # absolute position of each row's query
        d = tl.arange(0, HEAD_DIM)
        q_first = tl.load(q_first_ptr + b * stride_first)
        q_off = (q_first + token).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=live_row[:, None], other=0.0)

        hi = start + (tl.minimum(row0 + BLOCK_M, num_rows) - 1) // GROUP + 1  # last row's position + 1
        lo = 0
        if HAS_WINDOW:  # the first row sees keys (pos - window, pos]: skip whole chunks before that
            lo = tl.maximum(start + row0 // GROUP - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        if NUM_SPLITS > 1:  # this program's share of the tile's keys, in whole chunks (may be empty)
            span = tl.cdiv(hi - lo, NUM_SPLITS * BLOCK_N) * BLOCK_N
            lo = lo + split * span
            hi = tl.minimum(lo + span, hi)

        # Chunks wholly before the tile's first position are visible to every row: no mask there.
        mid = lo
        if not HAS_WINDOW:
            mid = tl.minimum(tl.maximum((start + row0 // GROUP + 1) // BLOCK_N * BLOCK_N, lo), hi)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        k_base, v_base = k_ptr + kvh * stride_khead, v_ptr + kvh * stride_khead
        ks_base, vs_base = ks_ptr + kvh, vs_ptr + kvh  # an FP8 cache's scales of this kv head
        bt_row = bt_ptr + b * stride_btb
        for t0 in range(lo, mid, BLOCK_N):
            m, denom, acc = _attend_chunk(
                q, m, denom, acc, t0, hi, pos, window, bt_row, k_base, v_base, ks_base, vs_base, d,
                stride_kblk, stride_kslot, stride_sblk, stride_sslot, qk_scale,
                BLOCK_SIZE, BLOCK_N, False, HAS_WINDOW, IEEE, FP8,
            )  # fmt: skip
        for t0 in range(mid, hi, BLOCK_N):
            m, denom, acc = _attend_chunk(
                q, m, denom, acc, t0, hi, pos, window, bt_row, k_base, v_base, ks_base, vs_base, d,
                stride_kblk, stride_kslot, stride_sblk, stride_sslot, qk_scale,
                BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, IEEE, FP8,
            )  # fmt: skip

        if NUM_SPLITS == 1:
            out = acc / denom[:, None]  # every live row attends its own key: denom > 0
            if SINKS:  # natural log-sum-exp (m and the logits are base 2)
                lse = (m + tl.math.log2(denom)) * 0.6931471805599453
                out = out * sink_share(lse, tl.load(sink_ptr + head))[:, None]
            o_off = (q_first + token).to(tl.int64) * stride_ot + head * stride_oh
            tl.store(out_ptr + o_off[:, None] + d[None, :], out, mask=live_row[:, None])
        else:  # a split may hold none of a row's keys (denom 0): its weight in the merge is 0
            nonempty = denom > 0
            safe = tl.where(nonempty, denom, 1.0)
            num_heads = tl.num_programs(2) // NUM_SPLITS * GROUP
            part = ((q_first + token).to(tl.int64) * num_heads + head) * NUM_SPLITS + split
            tl.store(
                part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / safe[:, None], mask=live_row[:, None]
            )
            # natural log-sum-exp, as the merge kernel reads it (m and the logits are base 2)
            lse = tl.where(nonempty, (m + tl.math.log2(safe)) * 0.6931471805599453, float("-inf"))
            tl.store(lse_ptr + part, lse, mask=live_row)


def supports(head_dim: int) -> bool:
    """Head dims the kernel compiles for (``tl.arange`` wants a power of two; 256 is the widest tile)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): float32 tiles and wide heads hold twice the registers per element."""
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32, 4
    return 64, 64, 4


def paged_context_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_first: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    max_new_tokens: int,
    window: int | None,
    scale: float,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [tokens, heads, d] (sequences back to back); layer_cache [2, blocks, block_size, kv_heads, d]
    -> out [tokens, heads * d]. ``kv_scales``: an FP8 cache's (``triton_attention.paged_decode_attention``).

    Sequence ``b``'s queries are rows ``q_first[b] .. q_first[b] + ends[b] - starts[b] - 1`` of ``q`` (``q_first``
    may be strided: the first column of the step's ``pad_index``), at
    positions ``starts[b] .. ends[b] - 1``; its keys/values ``[0, ends[b])`` are read from the cache
    through ``block_tables[b]``. ``max_new_tokens`` (a host int, the longest ``ends - starts``) sizes the
    grid. Index tensors are int32/int64 device tensors. ``num_splits``: key-range splits per tile (None:
    as many as the GPU needs to be filled, ``triton_attention.choose_num_splits``). ``sinks`` [heads]:
    gpt-oss's per-head sink logits (``triton_attention.paged_decode_attention`` says how they enter).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = layer_cache.shape
    assert cache_dim == head_dim and q.stride(-1) == 1 and layer_cache.is_contiguous() and supports(head_dim)
    group = num_heads // num_kv_heads
    starts, ends = starts.contiguous(), ends.contiguous()  # read as flat arrays
    block_m, block_n, num_warps = tile_config(head_dim, q.dtype)
    batch, tiles = block_tables.shape[0], triton.cdiv(max_new_tokens * group, block_m)
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch * tiles, num_kv_heads, max_context, sm_count(q.device))
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    part, lse = split_buffers(out, num_splits)
    sink_arg = out if sinks is None else sinks  # unused without sinks
    k, v = layer_cache[0], layer_cache[1]
    ks, vs, stride_sblk, stride_sslot = scale_halves(kv_scales, layer_cache, out)
    grid = (batch, tiles, num_kv_heads * num_splits)
    _context_kernel[grid](
        q,
        k,
        v,
        out,
        part,
        lse,
        sink_arg,
        ks,
        vs,
        block_tables,
        q_first,
        starts,
        ends,
        q_first.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        stride_sblk,
        stride_sslot,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        window or 0,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32,
        SINKS=sinks is not None,
        FP8=kv_scales is not None,
        num_warps=num_warps,
        num_stages=2,
    )
    merge_splits(part, lse, out, sinks, num_splits)
    return out.view(num_tokens, num_heads * head_dim)
