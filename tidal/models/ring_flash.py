"""Ring attention's blocks on CUDA through torch's flash-attention kernels (16-bit activations).

The plain block math of ``ring_attention`` scores each block in float32 against a ``[queries, keys]``
mask: memory that grows with the square of the chunk, and far from the GPU's attention speed. At bf16 or
fp16 on CUDA each block instead runs torch's flash-attention varlen kernel, which returns the block's
log-sum-exp, so the blocks merge by the same rule (``ring_core.merge_blocks``). A block is a set of
flash "sequences", because a packed row's segments are contiguous ranges of it (``block_spans``):

- the local block (diagonal): each piece of a segment inside this rank's chunk attends itself causally;
- an earlier rank's block: all its keys are in the past, and at most one segment reaches from that chunk
  into this one (segments are contiguous). That segment's queries (a prefix of this chunk) attend its
  keys (a suffix of that chunk) without a mask; no other query sees any key of the block.

Backward runs flash's backward on each block with the merged output and log-sum-exp, which gives the
block's share of dq, dk and dv (the kernel recomputes the block's probabilities from the final
log-sum-exp); the key/value gradients travel with the blocks as in the plain path. Sliding-window layers,
float32 and the CPU take the plain path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from torch import Tensor

from tidal.models import ring_core
from tidal.models.ring_core import RingLayout, head_slices, merge_blocks

FLASH_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Span:
    """What of one block attends: queries ``[0, q_end)`` of the local chunk and keys ``[k_start, chunk)``
    of the block, as flash varlen sequences of ``q_lens`` / ``k_lens`` tokens (causal on the diagonal)."""

    q_end: int
    k_start: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    causal: bool


def block_spans(starts: Sequence[int], chunk: int, rank: int) -> dict[int, Span]:
    """The ``Span`` of every block rank ``rank`` attends to, by owner (ranks ``<= rank``; an owner with no
    key any local query may see is left out). ``starts``: each segment's first index in the padded row
    (ascending, from 0); ``chunk``: tokens per rank."""
    lo, hi = rank * chunk, (rank + 1) * chunk
    cuts = [lo, *(s for s in starts if lo < s < hi), hi]
    pieces = tuple(b - a for a, b in zip(cuts, cuts[1:], strict=False))
    spans = {rank: Span(chunk, 0, pieces, pieces, True)}
    first = max(s for s in starts if s <= lo)  # the segment the chunk opens with
    after = [s for s in starts if s > first]
    end = min(after[0] if after else hi, hi)  # where it ends in this chunk
    for owner in range(rank):
        if first < (owner + 1) * chunk:  # it reaches back into the owner's chunk
            k_start = max(first, owner * chunk) - owner * chunk
            spans[owner] = Span(end - lo, k_start, (end - lo,), (chunk - k_start,), False)
    return spans


def padded_layout(lse: Tensor) -> bool:
    """Whether a flash varlen kernel's log-sum-exp is in the older, per-sequence padded layout."""
    return lse.dim() == 3


def rows_of_lse(lse: Tensor, q_lens: Sequence[int]) -> Tensor:
    """A flash varlen kernel's log-sum-exp as ``[total_q, H]``: the kernel returns ``[H, total_q]``
    (unpadded) or, in older torch builds, ``[sequences, H, max_q]`` (padded per sequence)."""
    if not padded_layout(lse):
        return lse.t()
    return torch.cat([lse[i, :, :n].t() for i, n in enumerate(q_lens)])


def lse_of_rows(rows: Tensor, q_lens: Sequence[int], padded: bool) -> Tensor:
    """``[total_q, H]`` back in the kernel's layout (``rows_of_lse``' inverse)."""
    if not padded:
        return rows.t().contiguous()
    out = rows.new_zeros(len(q_lens), rows.shape[1], max(q_lens))
    start = 0
    for i, n in enumerate(q_lens):
        out[i, :, :n] = rows[start : start + n].t()
        start += n
    return out


@dataclass
class FlashBlock:
    """A ``Span`` with its cumulative lengths on the device, as the kernels take them, and the layout of
    the log-sum-exp its forward returned (the layout the backward kernel takes back)."""

    span: Span
    cu_q: Tensor
    cu_k: Tensor
    lse_padded: bool | None = field(default=None, init=False)  # set by ``forward``

    @classmethod
    def build(cls, span: Span, device: torch.device) -> FlashBlock:
        def cu(lens):
            return torch.tensor(list(accumulate(lens, initial=0)), dtype=torch.int32, device=device)

        return cls(span, cu(span.q_lens), cu(span.k_lens))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
        """``(out [q_end, H, D], lse [q_end, H] float32, rng)`` of the span's queries over its keys."""
        s = self.span
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q[: s.q_end], k[s.k_start :], v[s.k_start :], self.cu_q, self.cu_k,
            max(s.q_lens), max(s.k_lens), 0.0, s.causal, False, scale=scale,
        )  # fmt: skip
        self.lse_padded = padded_layout(lse)
        return out, rows_of_lse(lse, s.q_lens), (seed, offset)

    def backward(
        self, dout, q, k, v, out, lse_rows, rng: tuple, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """This block's ``(dq [q_end], dk, dv [chunk - k_start])`` given the merged ``out``/``lse_rows``."""
        s = self.span
        e = s.q_end
        if self.lse_padded is None:
            raise RuntimeError("ring_flash: a flash block's backward ran before its forward")
        lse = lse_of_rows(lse_rows[:e], s.q_lens, self.lse_padded)
        return torch.ops.aten._flash_attention_backward(
            dout[:e], q[:e], k[s.k_start :], v[s.k_start :], out[:e], lse, self.cu_q, self.cu_k,
            max(s.q_lens), max(s.k_lens), 0.0, s.causal, rng[0], rng[1], scale=scale,
        )  # fmt: skip


def flash_usable(q: Tensor, dtype: torch.dtype, window: int | None) -> bool:
    """Whether ring attention of ``q`` computed in ``dtype`` runs on the flash kernels (CUDA, 16-bit, no
    sliding window, a head size flash takes)."""
    d = q.shape[-1]
    if not (q.is_cuda and dtype in FLASH_DTYPES and window is None and d % 8 == 0 and d <= 256):
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)  # flash attention 2 needs Ampere or later


def plan(layout: RingLayout) -> dict[int, FlashBlock]:
    """The blocks of this rank, built once per layout (one host read of the segment boundaries)."""
    cached = getattr(layout, "_flash_plan", None)
    if cached is None:
        seg = layout.segment_ids
        starts = [0, *((seg[1:] != seg[:-1]).nonzero().flatten() + 1).tolist()]
        spans = block_spans(starts, layout.chunk, layout.ring.rank)
        cached = {owner: FlashBlock.build(span, seg.device) for owner, span in spans.items()}
        object.__setattr__(layout, "_flash_plan", cached)  # a frozen dataclass: cache beside its fields
    return cached


def flash_ring_forward(q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, scale: float):
    """``(out [L, Hq, D] float32, lse [L, Hq] float32, rng)`` for local ``q`` ``[L, Hq, D]`` and
    ``k``/``v`` ``[L, Hk, D]``: the ring pass of ``ring_attention._ring_forward`` with flash blocks."""
    ring, blocks = layout.ring, plan(layout)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    block, rng = [k, v], None
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        shift = ring_core.Shift(block, ring) if step < ring.size - 1 else None
        if owner in blocks:  # a later rank's keys are all in the future of every local query
            o, l_, rng = blocks[owner].forward(q, block[0], block[1], scale)
            e = blocks[owner].span.q_end
            out[:e], lse[:e] = merge_blocks(out[:e], lse[:e], o.float(), l_)
        if shift is not None:
            block = shift.wait()
    return out, lse, rng


def flash_ring_backward(q, k, v, out, lse, dout, layout: RingLayout, rng: tuple, scale: float):
    """``(dq, dk, dv)`` float32 for ``flash_ring_forward``'s inputs, ``out`` in the inputs' dtype."""
    ring, blocks = layout.ring, plan(layout)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block = [k, v]
    grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        shift = ring_core.Shift(block, ring) if step < ring.size - 1 else None
        if owner in blocks:
            b = blocks[owner]
            dq_b, dk_b, dv_b = b.backward(dout, q, block[0], block[1], out, lse, rng, scale)
            dq[: b.span.q_end] += dq_b.float()
            grads[0][b.span.k_start :] += dk_b.float()
            grads[1][b.span.k_start :] += dv_b.float()
        grads = ring_core.Shift(grads, ring).wait()
        if shift is not None:
            block = shift.wait()
    return dq, grads[0], grads[1]


class FlashRingAttention(torch.autograd.Function):
    """Ring attention of one row on flash blocks: ``q`` ``[L, Hq, D]``, ``k``/``v`` ``[L, Hk, D]`` (16-bit)
    → ``[L, Hq, D]``, ``--ring_head_stride`` key/value heads (with their query heads) per ring pass."""

    @staticmethod
    def forward(ctx, q, k, v, layout: RingLayout, scale: float):
        groups = q.shape[1] // k.shape[1]
        outs, lses, rng = [], [], None
        for heads in head_slices(k.shape[1], layout.ring.head_stride):
            q_heads = slice(heads.start * groups, heads.stop * groups)
            o, l_, rng = flash_ring_forward(
                q[:, q_heads].contiguous(), k[:, heads].contiguous(), v[:, heads].contiguous(), layout, scale
            )
            outs.append(o)
            lses.append(l_)
        out = torch.cat(outs, dim=1).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=1))
        ctx.layout, ctx.scale, ctx.rng = layout, scale, rng
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        groups = q.shape[1] // k.shape[1]
        grad = grad.contiguous()
        dqs, dks, dvs = [], [], []
        for heads in head_slices(k.shape[1], ctx.layout.ring.head_stride):
            q_heads = slice(heads.start * groups, heads.stop * groups)
            dq, dk, dv = flash_ring_backward(
                q[:, q_heads].contiguous(), k[:, heads].contiguous(), v[:, heads].contiguous(),
                out[:, q_heads].contiguous(), lse[:, q_heads].contiguous(), grad[:, q_heads].contiguous(),
                ctx.layout, ctx.rng, ctx.scale,
            )  # fmt: skip
            dqs.append(dq)
            dks.append(dk)
            dvs.append(dv)
        return (
            torch.cat(dqs, dim=1).to(q.dtype),
            torch.cat(dks, dim=1).to(k.dtype),
            torch.cat(dvs, dim=1).to(v.dtype),
            None,
            None,
        )
