"""Batch-invariant causal attention (GQA, optional sliding window). Queries and keys are cut into blocks of
``KEY_BLOCK`` at fixed positions (keys from absolute position 0) and every (query block, key block) product,
``q_blk @ k_blk^T`` and then ``p_blk @ v_blk``, is one ``KEY_BLOCK``-square GEMM of a single ``bmm`` (the
same shape for all, so a query's scores depend neither on how many queries nor on how many keys share the
call, as ``matmul.linear``'s row blocks); the softmax sums reduce each key block in an order that depends
only on its length, then add the block sums in block order, so extra (masked, exactly-zero) key blocks
beyond a query's position change nothing: a decode query and the same query inside a prefill give the same
bits. (Before issue #34 the products were broadcast multiplies and sums: 3-4x slower in the trainer.)
On CUDA it runs the Triton kernel with fixed key blocks from position 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.rollout.batch_invariant import dispatch
from tidal.rollout.batch_invariant.elementwise import pointwise

KEY_BLOCK = 16  # keys reduced together in attention


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [B, Lq, H, D]`` (at positions ``q_pos [B, Lq]``) over each row's keys
    ``k, v [B, Lk, KV, D]`` at positions ``0..Lk-1``; key ``j`` is seen iff ``j <= q_pos`` (and within the
    sliding ``window``). Scores and softmax in float32; keys beyond a query's position may hold anything
    finite. Returns ``[B, Lq, H, D]`` in ``q``'s dtype."""
    if dispatch.on_triton(q):
        return dispatch.invariant(
            lambda q_, k_, v_: dispatch.kernels().attention(q_, k_, v_, q_pos, scale, window),
            lambda q_, k_, v_: _torch_attention(q_, k_, v_, q_pos, scale, window),
            q,
            k,
            v,
        )
    b, lq, h, d = q.shape
    lk, lqp = (-(-n // KEY_BLOCK) * KEY_BLOCK for n in (k.shape[1], lq))
    if lk != k.shape[1]:  # pad keys to whole blocks (masked below)
        pad = (0, 0, 0, 0, 0, lk - k.shape[1])
        k, v = F.pad(k, pad), F.pad(v, pad)
    kv_heads = k.shape[2]
    groups = h // kv_heads
    if lq == 1:  # a decode step: its own GEMM layout, the same bits
        return _one_query(q, k, v, q_pos, scale, window)
    qb, kb = lqp // KEY_BLOCK, lk // KEY_BLOCK
    qf = F.pad(q.float(), (0, 0, 0, 0, 0, lqp - lq))  # queries in whole blocks too (zero rows: dropped)
    # [B, KV, groups, qb, kb, KEY_BLOCK, D] views; the reshapes below copy each operand once
    q_blocks = qf.view(b, qb, KEY_BLOCK, kv_heads, groups, d).permute(0, 3, 4, 1, 2, 5)[:, :, :, :, None]
    q_blocks = q_blocks.expand(b, kv_heads, groups, qb, kb, KEY_BLOCK, d)
    k_blocks = _key_blocks(k, groups, qb)
    scores = torch.bmm(_gemm_rows(q_blocks), _gemm_rows(k_blocks).transpose(1, 2)).mul_(scale)
    # [B, H, Lq, Lk], the real queries only (a decode step has 1 of its block's 16): the softmax's cost
    # is per row
    scores = scores.view(b, h, qb, kb, KEY_BLOCK, KEY_BLOCK).permute(0, 1, 2, 4, 3, 5)
    scores = scores.reshape(b, h, lqp, lk)[:, :, :lq]
    p, denom_blocks = _softmax_numerators(scores, q_pos, window)
    p = F.pad(p, (0, 0, 0, lqp - lq))  # back to whole query blocks (zero rows) for the GEMMs
    p_blocks = p.view(b, h, qb, KEY_BLOCK, kb, KEY_BLOCK).transpose(3, 4)
    out_blocks = torch.bmm(_gemm_rows(p_blocks), _gemm_rows(_key_blocks(v, groups, qb)))
    out = _block_sum(out_blocks.view(b, h, qb, kb, KEY_BLOCK, d), 3)
    out = out.reshape(b, h, lqp, d)[:, :, :lq] / _block_sum(denom_blocks, -1)[..., None]
    return out.transpose(1, 2).to(q.dtype)


def _one_query(q, k, v, q_pos, scale: float, window: int | None) -> torch.Tensor:
    """``attention`` of one query per row (``q [B, 1, H, D]``; ``k, v [B, Lk, KV, D]``, ``Lk`` whole key
    blocks), bit for bit. A GEMM row's result depends neither on its place in its ``KEY_BLOCK``-row block
    nor on the other rows, the other GEMMs of the ``bmm`` or the operands' strides (as ``matmul.linear``'s;
    measured for these shapes), so the GEMM rows here are the query heads sharing a KV head (zero rows pad
    them to whole blocks) rather than 16 query positions of which 15 are padding (``groups`` times fewer
    GEMMs), and one ``bmm`` per KV head reads its key blocks in place (no copy of the keys). The softmax
    runs on the same ``[B, H, 1, Lk]`` tensor as ``attention``'s and the block sums add in the same order."""
    b, lk, kv_heads, d = k.shape
    h, kb = q.shape[2], lk // KEY_BLOCK
    groups = h // kv_heads
    rows = -(-groups // KEY_BLOCK) * KEY_BLOCK  # GEMM rows per KV head
    # per KV head, its queries repeated for every key block, zero rows padding them to whole row blocks
    q_blocks = q.new_zeros(kv_heads, b, kb, rows, d, dtype=torch.float32)
    q_blocks[:, :, :, :groups] = q.reshape(b, kv_heads, groups, d).transpose(0, 1)[:, :, None]
    k_heads, v_heads = (_head_blocks(t, rows // KEY_BLOCK) for t in (k, v))
    scores = q_blocks.new_empty(kv_heads, b * kb * rows // KEY_BLOCK, KEY_BLOCK, KEY_BLOCK)
    for i in range(kv_heads):
        torch.bmm(q_blocks[i].view(-1, KEY_BLOCK, d), k_heads[i].transpose(1, 2), out=scores[i])
    scores = scores.mul_(scale).view(kv_heads, b, kb, rows, KEY_BLOCK)[:, :, :, :groups]
    p, denom_blocks = _softmax_numerators(scores.permute(1, 0, 3, 2, 4).reshape(b, h, 1, lk), q_pos, window)
    p_blocks = p.new_zeros(kv_heads, b, kb, rows, KEY_BLOCK)
    p_blocks[:, :, :, :groups] = p.view(b, kv_heads, groups, kb, KEY_BLOCK).permute(1, 0, 3, 2, 4)
    out_blocks = p.new_empty(kv_heads, b * kb * rows // KEY_BLOCK, KEY_BLOCK, d)
    for i in range(kv_heads):
        torch.bmm(p_blocks[i].view(-1, KEY_BLOCK, KEY_BLOCK), v_heads[i], out=out_blocks[i])
    out = _block_sum(out_blocks.view(kv_heads, b, kb, rows, d), 2)[:, :, :groups]
    out = out.transpose(0, 1).reshape(b, h, 1, d) / _block_sum(denom_blocks, -1)[..., None]
    return out.transpose(1, 2).to(q.dtype)


def _head_blocks(x: torch.Tensor, rb: int) -> list[torch.Tensor]:
    """Keys or values ``[B, Lk, KV, D]`` → per KV head ``[B * kb * rb, KEY_BLOCK, D]`` float32: views (a
    row stride of ``KV * D``) unless ``rb > 1`` row blocks each need the key block repeated."""
    b, lk, kv_heads, d = x.shape
    blocks = x.float().contiguous().view(b * (lk // KEY_BLOCK), KEY_BLOCK, kv_heads, d)
    heads = [blocks[:, :, i] for i in range(kv_heads)]
    if rb == 1:
        return heads
    return [t[:, None].expand(t.shape[0], rb, KEY_BLOCK, d).reshape(-1, KEY_BLOCK, d) for t in heads]


def _softmax_numerators(scores, q_pos, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[B, H, Lq, Lk]`` (``Lk`` whole blocks) → ``exp(score - max)`` with unseen keys zero, and its
    sums over each key block ``[B, H, Lq, kb]`` (reduced in an order that depends only on ``KEY_BLOCK``)."""
    b, h, lq, lk = scores.shape
    j = torch.arange(lk, device=scores.device)
    seen = j[None, None, :] <= q_pos[:, :, None]  # [B, Lq, Lk]
    if window is not None:
        seen &= j[None, None, :] > q_pos[:, :, None] - window
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # a max is exact in any order
    p = pointwise(torch.exp, scores - top)  # [B, H, Lq, Lk]
    return p, p.view(b, h, lq, lk // KEY_BLOCK, KEY_BLOCK).sum(-1)


def _block_sum(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """The key blocks along ``dim`` added in block order (trailing all-masked blocks add exact zeros)."""
    total = blocks.select(dim, 0)
    for i in range(1, blocks.shape[dim]):
        total = total + blocks.select(dim, i)
    return total


def _key_blocks(x: torch.Tensor, groups: int, qb: int) -> torch.Tensor:
    """Keys or values ``[B, Lk, KV, D]`` (``Lk`` whole blocks) as the float32 view ``[B, KV, groups, qb,
    kb, KEY_BLOCK, D]``: each KV head repeated for its ``groups`` query heads and for every query block."""
    b, lk, kv_heads, d = x.shape
    blocks = x.float().view(b, lk // KEY_BLOCK, KEY_BLOCK, kv_heads, d).permute(0, 3, 1, 2, 4)
    return blocks[:, :, None, None].expand(b, kv_heads, groups, qb, lk // KEY_BLOCK, KEY_BLOCK, d)


def _gemm_rows(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., KEY_BLOCK, n]`` → ``[-1, KEY_BLOCK, n]``: every (query block, key block) product is one
    ``KEY_BLOCK``-row GEMM of a single ``bmm``, all of the same shape, so a query's result depends on
    neither the number of queries nor of keys."""
    return blocks.reshape(-1, KEY_BLOCK, blocks.shape[-1])


def _torch_attention(q, k, v, q_pos, scale: float, window: int | None) -> torch.Tensor:
    j = torch.arange(k.shape[1], device=q.device)
    seen = j[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        seen &= j[None, None, :] > q_pos[:, :, None] - window
    # KV heads repeated rather than ``enable_gqa`` (which not every masked SDPA kernel takes), so a masked
    # memory-efficient kernel can run: the math backend's [B, H, Lq, Lk] scores are large for long rows.
    groups = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=seen[:, None], scale=scale)
    return out.transpose(1, 2)
