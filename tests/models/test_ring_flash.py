"""Ring attention on flash blocks (``tidal.models.ring_flash``).

On the CPU: the spans of every block, rendered as masks, equal ``ring_attention.block_mask`` for random
packings (segments inside a chunk, across one boundary, across several, the padding segment); a block
hands its backward kernel the log-sum-exp in the layout its forward kernel returned (both layouts torch's
flash kernels have had, from stand-in kernels).

On one GPU: N ranks emulated by threads (``ring_core.Shift`` replaced by in-process mailboxes) run
the real forward and backward passes on bf16 inputs of a realistic size (8k-token rows, grouped heads,
head dim 128), against float32 plain attention of the whole row and against the one-rank flash result."""

from __future__ import annotations

import queue
import random
import threading
from collections import defaultdict

import pytest
import torch

from tidal.models import ring_attention as ra
from tidal.models import ring_core
from tidal.models import ring_flash as rf


def _packing(total: int, seed: int) -> list[int]:
    """Segment starts of a random packing of ``total`` tokens (short, long and chunk-spanning samples)."""
    rng = random.Random(seed)
    starts, at = [], 0
    while at < total:
        starts.append(at)
        at += rng.choice([1, 3, rng.randint(1, total // 2), rng.randint(1, total)])
    return starts


def _segment_ids(starts: list[int], total: int) -> torch.Tensor:
    seg = torch.zeros(total, dtype=torch.long)
    seg[starts[1:]] = 1
    return seg.cumsum(0)


def _render(span: rf.Span | None, chunk: int) -> torch.Tensor:
    mask = torch.zeros(chunk, chunk, dtype=torch.bool)
    if span is None:
        return mask
    if not span.causal:
        mask[: span.q_end, span.k_start :] = True
        return mask
    at = 0
    for n in span.q_lens:
        mask[at : at + n, at : at + n] = torch.ones(n, n, dtype=torch.bool).tril()
        at += n
    return mask


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("seed", range(8))
def test_block_spans_are_the_block_masks(size, seed):
    chunk = 12
    total = size * chunk
    starts = _packing(total, seed)
    seg = _segment_ids(starts, total)
    for rank in range(size):
        spans = rf.block_spans(starts, chunk, rank)
        assert set(spans) <= set(range(rank + 1)) and rank in spans
        q_idx = torch.arange(rank * chunk, (rank + 1) * chunk)
        for owner in range(size):
            k_idx = torch.arange(owner * chunk, (owner + 1) * chunk)
            want = ra.block_mask(q_idx, seg[q_idx], k_idx, seg[k_idx])
            assert torch.equal(_render(spans.get(owner), chunk), want), (rank, owner, starts)


class _Mailboxes:
    """``ring_core.Shift`` for ranks that are threads of one process: the i-th shift a rank makes
    sends to the i-th shift its next rank makes."""

    def __init__(self):
        self.boxes = defaultdict(queue.Queue)
        self.counts = defaultdict(int)
        self.lock = threading.Lock()

    def shift(self, tensors, ring):
        with self.lock:  # also around the lookups: two threads creating one missing queue would lose a put
            tag = self.counts[ring.rank]
            self.counts[ring.rank] += 1
            box, mine = self.boxes[(ring.next_rank, tag)], self.boxes[(ring.rank, tag)]
        for t in tensors:
            box.put(t.clone())

        class Pending:
            @staticmethod
            def wait():
                return [mine.get(timeout=120) for _ in tensors]

        return Pending()


def _emulated_ring(q, k, v, dout, seg, size: int, stride: int, scale: float):
    """Every rank's (out, dq, dk, dv) chunks, concatenated: the threads run ``FlashRingAttention``'s
    forward and backward passes (direct calls: autograd would run both ranks' backward on one thread)."""
    chunk = q.shape[0] // size
    results: dict[int, tuple] = {}
    errors = []

    def rank_main(rank: int):
        try:
            ring = ra.RingGroup(None, rank, size, tuple(range(size)), stride)
            layout = ra.RingLayout(ring, seg, chunk)
            part = slice(rank * chunk, (rank + 1) * chunk)
            ctx = type("Ctx", (), {"save_for_backward": lambda self, *t: setattr(self, "saved_tensors", t)})()
            out = rf.FlashRingAttention.forward(ctx, q[part], k[part], v[part], layout, scale)
            results[rank] = (out, *rf.FlashRingAttention.backward(ctx, dout[part])[:3])
        except BaseException as err:  # surfaced in the test thread
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return [torch.cat([results[r][i] for r in range(size)]) for i in range(4)]


def _reference(q, k, v, dout, seg, scale: float):
    """Float32 plain attention of the whole row (the one-rank plain path) with autograd gradients."""
    leaves = [t.float().transpose(0, 1).detach().requires_grad_() for t in (q, k, v)]  # [H, T, D]
    ring = ra.RingGroup(None, 0, 1, (0,), k.shape[1])
    out = ra._RingAttention.apply(*leaves, ra.RingLayout(ring, seg, q.shape[0]), scale)
    (out * dout.float().transpose(0, 1)).sum().backward()
    return [out.transpose(0, 1)] + [t.grad.transpose(0, 1) for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("size", "stride"), [(2, 1), (4, 2), (2, 2)])
def test_flash_ring_matches_plain_attention(monkeypatch, size, stride):
    torch.manual_seed(0)
    total, hq, hk, d = 8192, 12, 2, 128
    starts = [0, 37, 2100, 2101, 2105, 5000, 8000]  # one sample spans 3 chunks at size 4, short ones
    seg = _segment_ids(starts, total).cuda()
    q, k, v, dout = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk, hq))
    scale = d**-0.5
    mailboxes = _Mailboxes()
    monkeypatch.setattr(ring_core, "Shift", mailboxes.shift)
    ring = _emulated_ring(q, k, v, dout, seg, size, stride, scale)
    one = _emulated_ring(q, k, v, dout, seg, 1, stride, scale)  # the diagonal block only: plain varlen
    reference = _reference(q, k, v, dout, seg, scale)
    for name, got, single, want in zip(("out", "dq", "dk", "dv"), ring, one, reference, strict=True):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        # bf16 inputs and outputs: ~0.4% relative rounding; a wrong block or mask is O(1)
        assert _rel(got, want) < 1e-2, (name, _rel(got, want))
        assert _rel(got, single) < 1e-2, (name, _rel(got, single))


class _FakeFlash:
    """Stand-ins for torch's flash varlen kernels on the CPU: the forward returns a log-sum-exp (each query
    row's sum, per head) in the layout asked for, with a sentinel in the padding; the backward records the
    log-sum-exp it is given."""

    def __init__(self, padded: bool):
        self.padded, self.forward_lse, self.backward_lse = padded, None, None

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale=None):
        rows = q.sum(-1)  # [total_q, H]
        if not self.padded:
            lse = rows.t().contiguous()
        else:
            cuts = cu_q.tolist()
            lse = torch.full((len(cuts) - 1, q.shape[1], max_q), 1e9)
            for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
                lse[i, :, : b - a] = rows[a:b].t()
        self.forward_lse = lse
        return q.clone(), lse, torch.tensor(0), torch.tensor(0), torch.empty(0)

    def backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, seed, offset, scale=None
    ):
        self.backward_lse = lse
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize("padded", [False, True])
def test_flash_block_gives_backward_the_lse_layout_its_forward_returned(monkeypatch, padded):
    """Both log-sum-exp layouts torch's flash varlen forward has had (``[H, total_q]``; older builds
    ``[sequences, H, max_q]``): the block reads it as ``[q_end, H]`` rows and hands the backward kernel the
    merged rows back in the layout its own forward returned."""
    fake = _FakeFlash(padded)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake.forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fake.backward)
    span = rf.Span(q_end=5, k_start=0, q_lens=(2, 3), k_lens=(2, 3), causal=True)
    block = rf.FlashBlock.build(span, torch.device("cpu"))
    assert block.cu_q.dtype == torch.int32 and block.cu_q.tolist() == block.cu_k.tolist() == [0, 2, 5]
    q, k, v = (torch.randn(6, 2, 4) for _ in range(3))  # a chunk of 6 tokens, 2 heads
    with pytest.raises(RuntimeError, match="before its forward"):
        block.backward(q, q, k, v, q, q[:, :, 0], (None, None), 1.0)
    out, rows, rng = block.forward(q, k, v, 1.0)
    assert torch.equal(rows, q[:5].sum(-1))
    merged = torch.cat([rows, torch.zeros(1, 2)])  # the merged log-sum-exp of the whole chunk
    block.backward(q, q, k, v, q, merged, rng, 1.0)
    got, sent = fake.backward_lse, fake.forward_lse
    assert got.shape == sent.shape
    if padded:
        for i, n in enumerate(span.q_lens):
            assert torch.equal(got[i, :, :n], sent[i, :, :n])
    else:
        assert torch.equal(got, sent)
