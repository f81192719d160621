"""One Triton kernel for the common sampling step: temperature, Gumbel-max sampling and the log-prob.

``Sampler`` in torch makes a float32 copy of the ``[rows, vocab]`` logits, a log-softmax, and the
hash noise with about a dozen int64 tensor ops over the whole matrix: for 256 rows of a 152k vocabulary
that is gigabytes of memory traffic and ~3 ms per decode step. This kernel reads each row of logits
once: per row it keeps, lane by lane, a running max and sum of exponentials (the log-softmax
normaliser) and the best ``logit / T + gumbel`` with its index, then reduces the lanes.

It computes exactly what ``Sampler`` does (same hash, same Gumbel noise, IEEE division and libdevice
logarithms as torch uses on CUDA), so tokens agree with the torch path; log-probs agree to float32
rounding (the sum of exponentials is accumulated in another order). Used on CUDA when no row needs
top-k/top-p/min-p truncation or ``min_new_tokens`` suppression; the torch path handles the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # accurate logf, as torch's CUDA kernels use (triton >= 3.0 moved it)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older triton
    from triton.language.extra.cuda import libdevice

BLOCK = 2048


@triton.jit
def _mix32(x):
    """``tidal.rollout.sampler.mix32`` on uint32 (products wrap modulo 2**32, as the int64 masks do)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(
    logits_ptr, stride, temps_ptr, seeds_ptr, positions_ptr, tokens_ptr, logprobs_ptr, vocab,
    SAMPLE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    if SAMPLE:
        temp = tl.load(temps_ptr + row)
    else:
        temp = 0.0
    greedy = temp == 0.0
    divisor = tl.where(greedy, 1.0, temp)
    if SAMPLE:
        seed = tl.load(seeds_ptr + row).to(tl.uint32)
        pos = (tl.load(positions_ptr + row) * 0x9E3779B9 + 0x632BE5AB).to(tl.uint32)
        row_hash = _mix32(seed ^ _mix32(pos))
    offs = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), -3.0e38, tl.float32)  # finite: exp(-inf - -inf) would be nan
    run_sum = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        valid = idx < vocab
        x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(x, tl.full((BLOCK,), 1.0, tl.float32) * divisor)  # torch divides exactly
        new_max = tl.maximum(run_max, x)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
        run_max = new_max
        score = x
        if SAMPLE:
            cols = _mix32((idx.to(tl.int64) * 0x85EBCA6B).to(tl.uint32))
            bits = _mix32(row_hash ^ cols)
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            u = tl.minimum(u, 1.0 - 1.0 / 16777216.0)  # never 1.0 (see ``sampler.uniform_noise``)
            gumbel = -libdevice.log(-libdevice.log(u))
            score = tl.where(greedy, x, x + gumbel)
        score = tl.where(valid, score, float("-inf"))
        better = score > best  # strict: a lane keeps its first index on ties
        best = tl.where(better, score, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(run_max, 0)
    total = tl.sum(run_sum * tl.exp(run_max - top), 0)
    winner = tl.max(best, 0)
    token = tl.min(tl.where(best == winner, best_idx, vocab), 0)  # the first index among equal scores
    x_token = tl.math.div_rn(tl.load(base + token).to(tl.float32), divisor)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, x_token - top - libdevice.log(total))


def fused_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [rows], log-probs float32 [rows]); ``temperatures`` None: every row greedy."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sample = temperatures is not None
    if sample:  # the kernel reads element ``row`` of each: they must be dense [rows] vectors
        temperatures, seeds, positions = (t.contiguous() for t in (temperatures, seeds, positions))
    dummy = tokens  # unused pointers when every row is greedy
    _sample_kernel[(rows,)](
        logits, logits.stride(0), temperatures if sample else dummy, seeds if sample else dummy,
        positions if sample else dummy, tokens, logprobs, vocab, SAMPLE=sample, BLOCK=BLOCK,
    )  # fmt: skip
    return tokens, logprobs
