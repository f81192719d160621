"""Batch-invariant causal attention (GQA, optional sliding window). It reduces keys in blocks of
``KEY_BLOCK`` at fixed absolute key positions (within a block, in an order that depends only on its
length), then adds the block sums in block order, so extra (masked, exactly-zero) key blocks beyond a
query's position change nothing: a decode query and the same query inside a prefill give the same bits.
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
    lk = -(-k.shape[1] // KEY_BLOCK) * KEY_BLOCK
    if lk != k.shape[1]:  # pad keys to whole blocks (masked below)
        pad = (0, 0, 0, 0, 0, lk - k.shape[1])
        k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
    groups = h // k.shape[2]
    k = k.float().repeat_interleave(groups, dim=2)  # [B, Lk, H, D]
    v = v.float().repeat_interleave(groups, dim=2)
    scores = (q.float()[:, :, None] * k[:, None]).sum(-1) * scale  # [B, Lq, Lk, H]
    j = torch.arange(lk, device=q.device)
    seen = j[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        seen &= j[None, None, :] > q_pos[:, :, None] - window
    scores = scores.masked_fill(~seen[..., None], float("-inf"))
    top = scores.amax(dim=2, keepdim=True)  # a max is exact in any order
    p = pointwise(torch.exp, scores - top)  # [B, Lq, Lk, H]
    nb = lk // KEY_BLOCK
    p_blocks = p.view(b, lq, nb, KEY_BLOCK, h)
    denom_blocks = p_blocks.sum(3)  # [B, Lq, nb, H]
    out_blocks = (p_blocks[..., None] * v.view(b, 1, nb, KEY_BLOCK, h, d)).sum(3)  # [B, Lq, nb, H, D]
    denom, out = denom_blocks[:, :, 0], out_blocks[:, :, 0]
    for i in range(1, nb):  # block order: trailing all-masked blocks add exact zeros
        denom = denom + denom_blocks[:, :, i]
        out = out + out_blocks[:, :, i]
    return (out / denom[..., None]).to(q.dtype)


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
