"""Ring attention: exact causal attention over a packed row split along the sequence across N ranks.

A ring group (``RingGroup``, made by ``tidal.distributed.mesh.ring_group``) is N consecutive ranks that
all hold the same packed row ``[1, ΣT]`` (``tidal.data.collate``). The row is padded to a multiple of N
(the padding is a segment of its own) and cut into N contiguous chunks; rank r runs the model on chunk
r (its tokens, positions and segment ids). Inside every attention layer rank r has the queries, keys and
values of its chunk only, so the keys and values travel: N steps, each attending the local queries to
the block in hand while it is passed to the next rank (point-to-point send/recv, overlapped with the
compute), partial results merged by the log-sum-exp (online-softmax) rule. Blocks from later ranks lie
entirely in the future and are skipped. The result equals plain causal attention up to float rounding.

Backward (``_RingAttention``) is a second ring pass: the key/value blocks travel again and their
gradients travel with them, each rank adding its queries' contribution, until after N shifts every
block's dK/dV is back on the rank that owns it. Nothing ever holds the whole sequence's K/V.

Segment ids are not sent: every rank of the group has the whole packed row, so a block's segment ids
and token indices are known locally. ``--ring_head_stride`` (OpenRLHF's flag) is the number of key/value
heads passed around the ring at a time: a larger stride means fewer, larger messages (faster, more
memory); it must divide the model's key/value heads.

The per-block math (``attend_block``, ``merge_blocks``, ``block_grads``) is plain torch in float32,
tiled over query rows to bound the ``[rows, keys]`` score matrix; it runs on the CPU (gloo) and CUDA
(NCCL). On CUDA at bf16/fp16 (the training dtype under autocast) the blocks run on torch's
flash-attention kernels instead (``ring_flash.py``): no mask, memory linear in the chunk.

The HF plug-in is an ``AttentionInterface`` implementation, ``tidal_ring``: a model's first
ring forward switches it to it (``switch_to_ring``) and leaving the ``use_ring`` scope switches it
back, so checkpointed layers that recompute in backward take the ring path again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tidal.models import ring_core
from tidal.models.ring_core import (  # noqa: F401 (re-exported: the ring's names, one import for callers)
    RingGroup,
    RingLayout,
    block_mask,
    head_slices,
    merge_blocks,
    safe_lse,
)

RING = "tidal_ring"
ROW_TILE = 2048  # query rows (× grouped heads) scored at a time: bounds the fp32 [rows, keys] scores


_ACTIVE: RingGroup | None = None
# Models switched to ``tidal_ring`` inside the active ``use_ring`` scope: config id → (config, previous).
_SWITCHED: dict[int, tuple[Any, str]] = {}


def active_ring() -> RingGroup | None:
    """The ring group packed forwards run on (set by ``use_ring``), or None."""
    return _ACTIVE


@contextlib.contextmanager
def use_ring(ring: RingGroup | None) -> Iterator[RingGroup | None]:
    """Within the context, packed ``token_logprobs`` calls run as ring attention over ``ring``; the
    models they switched to ``tidal_ring`` get their attention implementation back on leaving it."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, ring
    try:
        yield ring
    finally:
        _ACTIVE = previous
        if previous is None:
            for config, impl in _SWITCHED.values():
                config._attn_implementation = impl
            _SWITCHED.clear()


# ---- the block math (pure functions) ---------------------------------------------------------------
def attend_block(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention of ``q`` ``[G, R, D]`` to one key block ``k``/``v`` ``[G, Lk, D]`` under
    ``allowed`` ``[Lq, Lk]`` (row r of ``q`` is query r mod Lq: grouped query heads stack their rows):
    ``(out [G, R, D], lse [G, R])`` in float32, normalised within the block (a row that sees no key
    gets out 0, lse −inf)."""
    outs, lses = [], []
    for rows in torch.arange(q.shape[1], device=q.device).split(ROW_TILE):
        s = (q[:, rows].float() @ k.float().transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[rows % allowed.shape[0]], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - safe_lse(lse)[..., None])
        outs.append(p @ v.float())
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def block_grads(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, lse: Tensor, dout: Tensor, delta: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of the gradients ``(dq, dk, dv)`` (float32), given the final ``lse`` of the
    queries and ``delta = Σ_d dout·out`` (the softmax backward's row term); shapes as ``attend_block``."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    kf, vf = k.float(), v.float()
    for rows in torch.arange(q.shape[1], device=q.device).split(ROW_TILE):
        qr = q[:, rows].float()
        s = (qr @ kf.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[rows % allowed.shape[0]], float("-inf"))
        p = torch.exp(s - safe_lse(lse[:, rows])[..., None])
        do = dout[:, rows].float()
        dv += p.transpose(-1, -2) @ do
        ds = p * (do @ vf.transpose(-1, -2) - delta[:, rows, None])
        dq[:, rows] = (ds @ kf) * scale
        dk += (ds.transpose(-1, -2) @ qr) * scale
    return dq, dk, dv


# ---- the ring --------------------------------------------------------------------------------------
def _grouped(q: Tensor, groups: int) -> Tensor:
    """``[Hq, L, D]`` → ``[Hk, g·L, D]``: each key/value head with the rows of the query heads it serves
    (HF's ``repeat_kv`` order: query head h reads key/value head h // g)."""
    hq, length, d = q.shape
    return q.reshape(hq // groups, groups * length, d)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, scale: float):
    """``(out [Hk, g·L, D], lse [Hk, g·L])`` for grouped queries ``q`` and local ``k``/``v`` ``[Hk, L, D]``."""
    ring = layout.ring
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    block = [k, v]
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        shift = ring_core.Shift(block, ring) if step < ring.size - 1 else None
        if owner <= ring.rank:  # a later rank's keys are all in the future of every local query
            allowed = layout.mask(owner)
            o, l_ = attend_block(q, block[0], block[1], allowed, scale)
            out, lse = merge_blocks(out, lse, o, l_)
        if shift is not None:
            block = shift.wait()
    return out, lse


def _ring_backward(q, k, v, out, lse, dout, layout: RingLayout, scale: float):
    """``(dq, dk, dv)`` in float32: K/V travel once more, their gradients with them, and after N shifts
    each block's gradient is back on its owner."""
    ring = layout.ring
    delta = (dout.float() * out).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block = [k, v]
    grads = [
        torch.zeros(k.shape, dtype=torch.float32, device=k.device),
        torch.zeros_like(v, dtype=torch.float32),
    ]
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        shift = ring_core.Shift(block, ring) if step < ring.size - 1 else None
        if owner <= ring.rank:
            allowed = layout.mask(owner)
            dq_b, dk_b, dv_b = block_grads(q, block[0], block[1], allowed, scale, lse, dout, delta)
            dq += dq_b
            grads = [grads[0] + dk_b, grads[1] + dv_b]
        grads = ring_core.Shift(grads, ring).wait()
        if shift is not None:
            block = shift.wait()
    return dq, grads[0], grads[1]


class _RingAttention(torch.autograd.Function):
    """Ring attention of one row: ``q`` ``[Hq, L, D]``, ``k``/``v`` ``[Hk, L, D]`` → ``[Hq, L, D]``,
    ``--ring_head_stride`` key/value heads (and their query heads) per ring pass. The math runs in
    float32 with autocast off, forward and backward alike (autocast would round the float32 blocks)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: RingLayout, scale: float):
        hq, length, d = q.shape
        hk = k.shape[0]
        groups = hq // hk
        gq = _grouped(q, groups)
        outs, lses = [], []
        with torch.autocast(q.device.type, enabled=False):
            for heads in head_slices(hk, layout.ring.head_stride):
                o, l_ = _ring_forward(gq[heads], k[heads], v[heads], layout, scale)
                outs.append(o)
                lses.append(l_)
        out, lse = torch.cat(outs), torch.cat(lses)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out.reshape(hq, length, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        hq, length, d = q.shape
        hk = k.shape[0]
        groups = hq // hk
        gq, gdout = _grouped(q, groups), _grouped(grad.contiguous(), groups)
        dqs, dks, dvs = [], [], []
        with torch.autocast(q.device.type, enabled=False):
            for heads in head_slices(hk, ctx.layout.ring.head_stride):
                dq, dk, dv = _ring_backward(
                    gq[heads], k[heads], v[heads], out[heads], lse[heads], gdout[heads], ctx.layout, ctx.scale
                )
                dqs.append(dq)
                dks.append(dk)
                dvs.append(dv)
        dq = torch.cat(dqs).reshape(hq, length, d).to(q.dtype)
        return dq, torch.cat(dks).to(k.dtype), torch.cat(dvs).to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, scale: float | None = None) -> Tensor:
    """Exact causal attention of this rank's chunk (``[Hq, L, D]`` queries, ``[Hk, L, D]`` keys/values)
    over the whole packed row spread across ``layout.ring``; differentiable."""
    if k.shape[0] % layout.ring.head_stride:
        from tidal.config.args import ConfigError  # a user error: the CLI reports it in one line

        raise ConfigError(
            f"--ring_head_stride {layout.ring.head_stride} must divide the model's {k.shape[0]} key/value heads"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # before any padding below
    from tidal.models.packed_attention import with_equal_head_dims

    # Values narrower than queries/keys (DeepSeek's MLA): both paths below take one head dim, so the
    # values are zero-padded and the output cut back (exact).
    return with_equal_head_dims(lambda q_, k_, v_: _ring_attention(q_, k_, v_, layout, scale), q, k, v)


def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout, scale: float):
    from tidal.models.ring_flash import FlashRingAttention, flash_usable

    if flash_usable(q, q.dtype, layout.window):  # CUDA at 16 bits: flash blocks ([L, H, D] layout)
        with torch.autocast(q.device.type, enabled=False):
            out = FlashRingAttention.apply(
                *(t.transpose(0, 1).contiguous() for t in (q, k, v)), layout, scale
            )
        return out.transpose(0, 1)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), layout, scale)


def head_stride_problem(model: nn.Module, stride: int) -> str | None:
    """Why ``--ring_head_stride`` cannot split ``model``'s key/value heads, or None."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if heads is not None and heads % stride:
        return f"--ring_head_stride {stride} must divide the model's {heads} key/value heads"
    return None


# ---- the sequence split and the gather -------------------------------------------------------------
def padded_length(length: int, size: int) -> int:
    """The packed row's length rounded up to a multiple of the ring size."""
    return -(-length // size) * size


def pad_row(t: Tensor, size: int, value: int) -> Tensor:
    """``[1, T]`` → ``[1, T']`` (T' a multiple of ``size``), filled with ``value``."""
    return nn.functional.pad(t, (0, padded_length(t.shape[-1], size) - t.shape[-1]), value=value)


def local_chunk(t: Tensor, ring: RingGroup) -> Tensor:
    """This rank's contiguous chunk of a padded ``[1, T']`` row."""
    chunk = t.shape[-1] // ring.size
    return t[..., ring.rank * chunk : (ring.rank + 1) * chunk]


class _GatherChunks(torch.autograd.Function):
    """All-gather the chunks of a ``[1, L]`` row along the sequence. Every rank of the ring then computes
    the same loss from the same full row, so each rank's upstream gradient is the whole row's; backward
    keeps this rank's slice of it (the other ranks take theirs), with no communication."""

    @staticmethod
    def forward(ctx, local: Tensor, ring: RingGroup):
        parts = [torch.empty_like(local) for _ in range(ring.size)]
        dist.all_gather(parts, local.contiguous(), group=ring.group)
        ctx.ring, ctx.chunk = ring, local.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.ring.rank * ctx.chunk
        return grad[..., start : start + ctx.chunk].contiguous(), None


def gather_chunks(local: Tensor, ring: RingGroup) -> Tensor:
    """The full padded row from every rank's ``[1, L]`` chunk (differentiable, see ``_GatherChunks``)."""
    return _GatherChunks.apply(local, ring)


class _GatherRows(torch.autograd.Function):
    """All-gather rows ``[n_r, ...]`` of uneven counts (``counts[r]`` on rank r, known to every rank) in
    rank order; like ``_GatherChunks``, backward keeps this rank's rows of the gradient."""

    @staticmethod
    def forward(ctx, local: Tensor, counts: tuple[int, ...], ring: RingGroup):
        width = max(max(counts), 1)  # all_gather takes equal shapes: pad every rank's rows to the most
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(ring.size)]
        dist.all_gather(parts, padded, group=ring.group)
        ctx.start, ctx.count = sum(counts[: ring.rank]), counts[ring.rank]
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start : ctx.start + ctx.count].contiguous(), None, None


def gather_rows(local: Tensor, counts: Sequence[int], ring: RingGroup) -> Tensor:
    """Every rank's rows, in rank order, from each rank's ``[counts[rank], ...]`` (differentiable, see
    ``_GatherRows``): the values a loss reads at a few positions of the row (PRM's step tokens)."""
    if local.shape[0] != counts[ring.rank]:
        raise ValueError(
            f"rank {ring.rank} of the ring has {local.shape[0]} rows, expected {counts[ring.rank]}"
        )
    return _GatherRows.apply(local, tuple(int(n) for n in counts), ring)


class Turns:
    """``(mine, item)`` for every item of every rank of the ring group, in the same order on all of them,
    and ``total``: how many turns, the same on every rank of the group.

    Each rank keeps its own data; for ring attention the group takes turns, all of its ranks running
    the forward (and backward) of one rank's micro-batch together. Items are all-gathered as Python
    objects (move tensors to the CPU first); a rank holding fewer items than another sits out the
    turns it has no item for (every rank still runs the others' turns). So the turns are the sum of
    the ranks' counts, not this rank's count times the ring size: a caller acting on the final turn
    (the gradient sync of an accumulation) compares its turn index with ``total - 1``. The counts are
    gathered when the ``Turns`` is made, so ``total`` is known before the first turn."""

    def __init__(self, items: Sequence[Any], ring: RingGroup | None):
        self.items, self.ring = items, ring
        counts: list = [len(items)] if ring is None else [None] * ring.size
        if ring is not None:
            dist.all_gather_object(counts, len(items), group=ring.group)
        self.counts = tuple(counts)
        self.total = sum(self.counts)

    def __iter__(self) -> Iterator[tuple[bool, Any]]:
        items, ring = self.items, self.ring
        if ring is None:
            yield from ((True, item) for item in items)
            return
        for i in range(max(self.counts)):
            gathered: list = [None] * ring.size
            dist.all_gather_object(gathered, items[i] if i < len(items) else None, group=ring.group)
            for owner, theirs in enumerate(gathered):
                if i < self.counts[owner]:
                    yield owner == ring.rank, theirs


def turns(items: Sequence[Any], ring: RingGroup | None) -> Turns:
    """The ring group's ``Turns`` over ``items`` (this rank's); without a ring, each item in order."""
    return Turns(items, ring)


# ---- the Hugging Face plug-in ----------------------------------------------------------------------
@cache
def register() -> None:
    """Register ``tidal_ring`` with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(RING, ring_attention_forward)
    AttentionMaskInterface.register(RING, _no_mask)


def _no_mask(*args, **kwargs):
    """Ring attention builds its block masks from segment ids; HF builds no mask."""
    return None


def switch_to_ring(model: nn.Module) -> None:
    """Run ``model``'s attention as ``tidal_ring`` until the ``use_ring`` scope ends. Not just for one
    forward: a checkpointed layer recomputes its forward during backward, and must take the same path."""
    register()
    config = model.config
    if config._attn_implementation != RING:  # read by every attention layer at call time
        _SWITCHED[id(config)] = (config, config._attn_implementation)
        config._attn_implementation = RING


def ring_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """HF attention signature: ``query`` ``[1, H, L, D]`` of this rank's chunk → ``([1, L, H, D], None)``;
    the ring layout comes in the ``tidal_ring`` keyword the forward was called with."""
    layout: RingLayout | None = kwargs.get("tidal_ring")
    if layout is None:
        raise RuntimeError("tidal_ring attention needs the ring layout (run it through token_logprobs)")
    if query.shape[0] != 1:
        raise ValueError(f"ring attention takes one packed row, got a batch of {query.shape[0]}")
    if dropout > 0 and module.training:
        raise ValueError("ring attention has no attention dropout; set the model's attention_dropout to 0")
    if kwargs.get("softcap") is not None:
        raise ValueError("ring attention does not support attention logit soft-capping")
    if sliding_window is not None:
        layout = RingLayout(layout.ring, layout.segment_ids, layout.chunk, sliding_window)
    from tidal.models.packed_attention import attention_dtype
    from tidal.models.ring_flash import flash_usable

    q, k, v = query[0], key[0], value[0]
    dtype = attention_dtype(query)  # under autocast RoPE leaves q/k in float32
    if flash_usable(q, dtype, layout.window):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = ring_attention(q, k, v, layout, scaling)
    return out.transpose(0, 1)[None], None
