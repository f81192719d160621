"""Exact mode's attention on CUDA (``triton_exact`` re-exports it). ``attention``: ``QUERY_BLOCK`` (query, head)
rows of one KV head per program (a decode step's GQA group reads its keys once) over keys in ``KEY_BLOCK``
blocks at fixed absolute positions, online softmax in block order; a block a query sees none of leaves its
state bit-unchanged (alpha is exactly 1, it adds exact zeros), so the keys beyond a query's position, the
other queries of its tile and whether it is a prefill or a decode query change nothing.
``paged_attention``: the same kernel reading the engine's paged KV cache in place through the block table
(each key's slot computed from its position): the same key blocks in the same order as over the gathered
keys, so the same bits.

Keys and values beyond a query's position may hold anything finite (stale cache slots, padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QUERY_BLOCK, KEY_BLOCK = 32, 64  # one configuration: changing it changes results, never correctness


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    bt_ptr,
    sbt,
    Lq,
    Lk,
    KV,
    scale,
    sqb,
    sql,
    sqh,
    sqd,
    skb,
    skl,
    skh,
    skd,
    svb,
    svl,
    svh,
    svd,
    spb,
    spl,
    sob,
    sol,
    soh,
    sod,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    PAGE: tl.constexpr,
):  # WINDOW: the sliding window (0: none); PAGE: keys in a paged cache of PAGE-slot blocks (0: dense)
    # A tile's rows are (query, head) pairs of one KV head: row r is query r // GROUPS, head
    # kvh * GROUPS + r % GROUPS, so a decode step's GQA group shares one read of its keys.
    bkv = tl.program_id(1).to(tl.int64)
    b, kvh = bkv // KV, bkv % KV
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // GROUPS
    h = kvh * GROUPS + rows % GROUPS
    dims = tl.arange(0, BLOCK_D)
    live = qi < Lq
    dmask = dims < HEAD_DIM
    # a padding row (past the last query) sits at position -1: it sees no key
    pos = tl.load(pos_ptr + b * spb + qi * spl, mask=live, other=-1).to(tl.int32)
    q = tl.load(
        q_ptr + b * sqb + qi[:, None] * sql + h[:, None] * sqh + dims[None, :] * sqd,
        mask=live[:, None] & dmask[None, :],
        other=0.0,
    )
    # Key blocks [lo, hi): every block any row of the tile sees. The blocks outside it are ones each of
    # these rows sees nothing of, which would leave its state unchanged: skipping them is exact.
    # (Blocks past Lk, if a position were, are masked by ``kin``.)
    hi = tl.max(pos, axis=0) + 1
    lo = 0
    if WINDOW:
        first = tl.min(tl.where(live, pos, 2147483647), axis=0) - WINDOW + 1
        lo = (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N
    scale = tl.full((), scale, tl.float32)  # float64 under inductor (triton_exact_rows._rms_norm_kernel)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + keys
        kin = kpos < Lk
        if PAGE:  # key j of row b: slot j % PAGE of cache block block_tables[b, j // PAGE]
            page = tl.load(bt_ptr + b * sbt + kpos // PAGE, mask=kin, other=0).to(tl.int64)
            slot = page * PAGE + kpos % PAGE
            k_rows, v_rows = slot * skl, slot * svl
        else:
            k_rows, v_rows = b * skb + kpos * skl, b * svb + kpos * svl
        k = tl.load(
            k_ptr + k_rows[None, :] + kvh * skh + dims[:, None] * skd,
            mask=kin[None, :] & dmask[:, None],
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        seen = (kpos[None, :] <= pos[:, None]) & kin[None, :]
        if WINDOW:
            seen &= kpos[None, :] > pos[:, None] - WINDOW
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # a row that sees nothing new keeps m: alpha exactly 1, and p is all exact zeros
        alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - m_safe))
        p = tl.where(seen, tl.exp(s - m_safe[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + v_rows[:, None] + kvh * svh + dims[None, :] * svd,
            mask=kin[:, None] & dmask[None, :],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + b * sob + qi[:, None] * sol + h[:, None] * soh + dims[None, :] * sod,
        out.to(o_ptr.dtype.element_ty),
        mask=live[:, None] & dmask[None, :],
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``batch_invariant.attention``'s contract (causal, GQA, optional sliding window; key ``j`` at
    position ``j``) on CUDA: ``q [B, Lq, H, D]``, ``k, v [B, Lk, KV, D]``, ``q_pos [B, Lq]`` ->
    ``[B, Lq, H, D]`` in ``q``'s dtype."""
    # no block table (PAGE=0 never reads it): q_pos stands in for its pointer
    return _launch_attention(q, k, v, k.stride(), v.stride(), k.shape[1], q_pos, q_pos, 0, 0, scale, window)


def paged_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``attention`` with row ``b``'s key ``j`` read in place from the paged cache ``layer_cache [2, blocks,
    page, KV, D]`` (keys, values) at slot ``j % page`` of block ``block_tables[b, j // page]``: the same
    key blocks in the same order as ``attention`` over the gathered ``[B, width * page, KV, D]`` keys, so
    the same bits, without the gathered copy (the block table's whole width per row, per layer)."""
    page = layer_cache.shape[2]
    keys, values = (layer_cache[i].flatten(0, 1) for i in (0, 1))  # [slots, KV, D]
    table = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    return _launch_attention(
        q, keys, values, (0, *keys.stride()), (0, *values.stride()), table.shape[1] * page,
        q_pos, table, table.stride(0), page, scale, window,
    )  # fmt: skip


def _launch_attention(q, k, v, k_strides, v_strides, lk, q_pos, table, table_stride, page, scale, window):
    """``_attention_kernel`` over ``q [B, Lq, H, D]`` with ``lk`` keys per row (``k``/``v``'s strides given:
    a paged cache has no batch stride)."""
    b, lq, h, d = q.shape
    kv = k.shape[-2]
    out = torch.empty(b, lq, h, d, dtype=q.dtype, device=q.device)
    if b * lq * h == 0:
        return out
    pos = q_pos.expand(b, lq)
    groups = h // kv
    grid = (triton.cdiv(lq * groups, QUERY_BLOCK), b * kv)
    _attention_kernel[grid](
        q, k, v, pos, out, table, table_stride, lq, lk, kv, float(scale),
        *q.stride(), *k_strides, *v_strides, *pos.stride(), *out.stride(),
        GROUPS=groups, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=QUERY_BLOCK,
        BLOCK_N=KEY_BLOCK, WINDOW=window or 0, IEEE=q.dtype == torch.float32, PAGE=page,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
