"""Ring attention (``tidal.models.ring_attention``): the block math on one process, and the ring over 2
CPU processes (gloo) against plain attention of the whole packed row: outputs and gradients of the op
(uneven segments, grouped heads, both head strides, a sliding window) and of a tiny model's log-probs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tidal.models import ring_attention as ra

WORKER = Path(__file__).with_name("ring_worker.py")


def test_blocks_merge_to_full_attention():
    """Attending to two key blocks and merging by log-sum-exp equals attending to both at once."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 4), torch.randn(2, 10, 4), torch.randn(2, 10, 4)
    allowed = torch.rand(6, 10) > 0.3
    allowed[0] = False  # a row that sees no key at all stays 0
    full, lse = ra.attend_block(q, k, v, allowed, 0.5)
    a = ra.attend_block(q, k[:, :4], v[:, :4], allowed[:, :4], 0.5)
    b = ra.attend_block(q, k[:, 4:], v[:, 4:], allowed[:, 4:], 0.5)
    merged, merged_lse = ra.merge_blocks(*a, *b)
    torch.testing.assert_close(merged, full)
    torch.testing.assert_close(merged_lse, lse)
    assert torch.all(full[:, 0] == 0) and torch.all(torch.isinf(lse[:, 0]))


def test_block_grads_match_autograd():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, n, 4, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
    allowed = torch.rand(5, 7) > 0.4
    allowed[:, 0] = True
    out, lse = ra.attend_block(q, k, v, allowed, 0.3)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    delta = (dout * out).sum(-1)
    dq, dk, dv = ra.block_grads(q.detach(), k.detach(), v.detach(), allowed, 0.3, lse.detach(), dout, delta)
    for mine, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, ref.float(), atol=1e-5, rtol=1e-5)


def test_two_ranks_match_plain_attention(tiny_llama):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(tiny_llama)]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
