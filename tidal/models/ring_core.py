"""The pieces ring attention's two block paths share (``ring_attention``'s plain float32 math and
``ring_flash``'s flash kernels): where a packed row's blocks are (``RingLayout``), which
query may see which key (``block_mask``), the log-sum-exp merge of two partial attentions, and the
asynchronous shift of tensors to the next rank of the ring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from tidal.distributed.mesh import RingGroup as RingGroup  # the group type lives with its factory


def block_mask(
    q_idx: Tensor, q_seg: Tensor, k_idx: Tensor, k_seg: Tensor, window: int | None = None
) -> Tensor:
    """``[Lq, Lk]`` boolean: query i may attend key j (same segment, j not after i, within ``window``).

    ``*_idx`` are token indices in the whole packed row, ``*_seg`` its segment ids."""
    diff = q_idx[:, None] - k_idx[None, :]
    allowed = (diff >= 0) & (q_seg[:, None] == k_seg[None, :])
    if window is not None:
        allowed &= diff < window
    return allowed


def safe_lse(lse: Tensor) -> Tensor:
    """``lse`` with −inf (a row that sees no key) replaced by 0, so ``exp(s − lse)`` stays 0, not NaN."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def merge_blocks(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two normalised partial attentions over disjoint key sets (the log-sum-exp rule)."""
    new = torch.logaddexp(lse, lse_b)
    safe = safe_lse(new)
    merged = out * torch.exp(lse - safe)[..., None] + out_b * torch.exp(lse_b - safe)[..., None]
    return merged, new


@dataclass(frozen=True)
class RingLayout:
    """Where the blocks of one packed row are: its chunk length and the whole row's segment ids."""

    ring: RingGroup
    segment_ids: Tensor  # [N·L] of the padded row (every rank has all of it)
    chunk: int  # L: tokens per rank
    window: int | None = None

    def block(self, owner: int) -> tuple[Tensor, Tensor]:
        """Token indices and segment ids of ``owner``'s chunk."""
        start = owner * self.chunk
        idx = torch.arange(start, start + self.chunk, device=self.segment_ids.device)
        return idx, self.segment_ids[start : start + self.chunk]

    def mask(self, owner: int) -> Tensor:
        """``[L, L]``: local queries × ``owner``'s keys."""
        q_idx, q_seg = self.block(self.ring.rank)
        k_idx, k_seg = self.block(owner)
        return block_mask(q_idx, q_seg, k_idx, k_seg, self.window)


class Shift:
    """Send tensors to the next rank of the ring and receive the previous rank's (asynchronously)."""

    def __init__(self, tensors: Sequence[Tensor], ring: RingGroup):
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        self.received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, ring.next_rank, ring.group) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, r, ring.prev_rank, ring.group) for r in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


def head_slices(kv_heads: int, stride: int) -> list[slice]:
    """``stride`` key/value heads at a time (``--ring_head_stride``)."""
    return [slice(h, h + stride) for h in range(0, kv_heads, stride)]
