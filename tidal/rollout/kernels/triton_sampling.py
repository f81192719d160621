"""Triton kernels for the common sampling step: temperature, Gumbel-max sampling and the log-prob.

``Sampler`` in torch makes a float32 copy of the ``[rows, vocab]`` logits, a log-softmax, and the
hash noise with about a dozen int64 tensor ops over the whole matrix: for 256 rows of a 152k vocabulary
that is gigabytes of memory traffic and ~3 ms per decode step. These kernels read each row of logits
once: lane by lane they keep a running max and sum of exponentials (the log-softmax normaliser) and the
best ``logit / T + gumbel`` with its index, then reduce the lanes.

Each element costs two integer hashes, two logarithms, two exponentials and an exact division, so one
program per row (a few hundred programs on a 132-SM GPU) leaves the GPU mostly idle. ``fused_sample``
therefore splits each row's vocabulary into contiguous chunks (``_partial_kernel``, grid rows x chunks:
each program writes its chunk's max, sum of exponentials relative to that max, best score and the first
index of it to small scratch buffers), then combines a row's chunks (``_combine_kernel``, grid rows):
the max of the maxes, the sums rescaled to it, and the best score with ties going to the lowest index
(chunks are in index order). The chunk count is a function of (rows, vocab, SM count) only, so the
launch is static and CUDA graphs capture it. The split programs also skip, by branches uniform over a
program, the division when the divisor is 1 (T = 1 and greedy rows) and the noise of greedy rows: work
whose result is known (``_scan``). ``chunks=1`` runs the one-program-per-row kernel (``_sample_kernel``,
today's kernel unchanged), the reference the split is tested against.

It computes exactly what ``Sampler`` does (same hash, same Gumbel noise, IEEE division and libdevice
logarithms as torch uses on CUDA), so tokens agree with the torch path, and the split and one-program
kernels pick bit-identical tokens for every input (every element's score is the same float; the winner
is the first index of the maximal score either way). Log-probs agree to float32 rounding: the sum of
exponentials is accumulated in another order than torch's, and the split kernels add the chunks' sums
in yet another order than the one-program kernel (a difference of a few ulps of the log-sum-exp).
Used on CUDA when no row needs top-k/top-p/min-p truncation or ``min_new_tokens`` suppression; the
torch path handles the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.accel import sm_count

try:  # accurate logf, as torch's CUDA kernels use (triton >= 3.0 moved it)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older triton
    from triton.language.extra.cuda import libdevice

BLOCK = 2048  # lanes of the one-program-per-row kernel
# Lanes and warps of the split kernel's programs: 4 elements per thread keep it at 48 registers (sm_90,
# triton 3.6), so 10 programs fit on an SM at once (2048 lanes on 4 warps, the one-program kernel's
# shape, take 161 registers: 3 programs).
SPLIT_BLOCK = 512
SPLIT_WARPS = 4
PROGRAMS_PER_SM = 8  # enough resident warps to hide the hash/log latency
MIN_BLOCKS_PER_CHUNK = 4  # below that, the combine and the per-program setup outweigh the gain
NO_MAX = tl.constexpr(-3.0e38)  # the running max's start: finite, since exp(-inf - -inf) would be nan


@triton.jit
def _mix32(x):
    """``tidal.rollout.runner.sampler.mix32`` on uint32 (products wrap modulo 2**32, as the int64 masks do)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_settings(temps_ptr, seeds_ptr, positions_ptr, row, SAMPLE: tl.constexpr):
    """(temperature, divisor, row hash) of ``row``; without ``SAMPLE`` every row is greedy (temperature 0,
    divisor 1, hash unused)."""
    if SAMPLE:
        temp = tl.load(temps_ptr + row)
        seed = tl.load(seeds_ptr + row).to(tl.uint32)
        pos = (tl.load(positions_ptr + row) * 0x9E3779B9 + 0x632BE5AB).to(tl.uint32)
        row_hash = _mix32(seed ^ _mix32(pos))
    else:
        temp = 0.0
        row_hash = 0
    return temp, tl.where(temp == 0.0, 1.0, temp), row_hash


@triton.jit
def _gumbel(idx, row_hash):
    """``-log(-log(u))`` of ``sampler.uniform_noise`` at token ids ``idx`` of the row hashed to ``row_hash``."""
    cols = _mix32((idx.to(tl.int64) * 0x85EBCA6B).to(tl.uint32))
    bits = _mix32(row_hash ^ cols)
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    u = tl.minimum(u, 1.0 - 1.0 / 16777216.0)  # never 1.0 (see ``sampler.uniform_noise``)
    return -libdevice.log(-libdevice.log(u))


@triton.jit
def _scan(
    base, lo, hi, temp, divisor, row_hash,
    SAMPLE: tl.constexpr, BLOCK: tl.constexpr, SHORTCUTS: tl.constexpr, LOGPROBS: tl.constexpr,
):  # fmt: skip
    """Lane-wise running (max, sum of exp relative to it, best score, first index of it) of the scaled
    logits ``base[lo:hi]`` (``lo`` a multiple of ``BLOCK``).

    ``SHORTCUTS`` skips, by branches uniform over the program, work whose result is known: the division
    when the divisor is 1 (T = 1 and greedy rows: ``div.rn`` by 1 returns its input, subnormals included)
    and the noise of greedy rows (unused). The same floats come out either way. Without ``LOGPROBS`` the
    running max and sum (the log-prob's normaliser, two exponentials an element) are not kept: they stay
    ``NO_MAX`` and 0; the draw does not read them."""
    offs = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), NO_MAX, tl.float32)
    run_sum = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        valid = idx < hi
        x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
        if SHORTCUTS:
            if divisor != 1.0:
                x = tl.math.div_rn(x, tl.full((BLOCK,), 1.0, tl.float32) * divisor)
        else:
            x = tl.math.div_rn(x, tl.full((BLOCK,), 1.0, tl.float32) * divisor)  # torch divides exactly
        if LOGPROBS:
            new_max = tl.maximum(run_max, x)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
            run_max = new_max
        score = x
        if SAMPLE:
            if SHORTCUTS:
                if temp != 0.0:
                    score = x + _gumbel(idx, row_hash)
            else:
                score = tl.where(temp == 0.0, x, x + _gumbel(idx, row_hash))
        score = tl.where(valid, score, float("-inf"))
        better = score > best  # strict: a lane keeps its first index on ties
        best = tl.where(better, score, best)
        best_idx = tl.where(better, idx, best_idx)
    return run_max, run_sum, best, best_idx


@triton.jit
def _reduce(run_max, run_sum, best, best_idx, vocab):
    """Lanes (or chunks) -> (max, sum of exp relative to it, best score, the lowest index holding it)."""
    top = tl.max(run_max, 0)
    total = tl.sum(run_sum * tl.exp(run_max - top), 0)
    winner = tl.max(best, 0)
    token = tl.min(tl.where(best == winner, best_idx, vocab), 0)  # the first index among equal scores
    return top, total, winner, token


@triton.jit
def _finish(base, row, token, divisor, top, total, tokens_ptr, logprobs_ptr, LOGPROBS: tl.constexpr):
    tl.store(tokens_ptr + row, token.to(tl.int64))
    if LOGPROBS:
        x_token = tl.math.div_rn(tl.load(base + token).to(tl.float32), divisor)
        tl.store(logprobs_ptr + row, x_token - top - libdevice.log(total))


@triton.jit
def _sample_kernel(
    logits_ptr, stride, temps_ptr, seeds_ptr, positions_ptr, tokens_ptr, logprobs_ptr, vocab,
    SAMPLE: tl.constexpr, BLOCK: tl.constexpr, LOGPROBS: tl.constexpr,
):  # fmt: skip
    """One program per row walks the whole vocabulary (``chunks=1``)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    temp, divisor, row_hash = _row_settings(temps_ptr, seeds_ptr, positions_ptr, row, SAMPLE)
    run_max, run_sum, best, best_idx = _scan(
        base, 0, vocab, temp, divisor, row_hash, SAMPLE, BLOCK, False, LOGPROBS
    )
    top, total, _, token = _reduce(run_max, run_sum, best, best_idx, vocab)
    _finish(base, row, token, divisor, top, total, tokens_ptr, logprobs_ptr, LOGPROBS)


@triton.jit
def _partial_kernel(
    logits_ptr, stride, temps_ptr, seeds_ptr, positions_ptr, stats_ptr, index_ptr, vocab, chunk_size,
    SAMPLE: tl.constexpr, BLOCK: tl.constexpr, LOGPROBS: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the chunk's (max, sum, best score) into ``stats[0..2, row, chunk]`` and the
    first index of its best score into ``index[row, chunk]``."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    base = logits_ptr + row.to(tl.int64) * stride
    temp, divisor, row_hash = _row_settings(temps_ptr, seeds_ptr, positions_ptr, row, SAMPLE)
    lo = chunk * chunk_size
    hi = tl.minimum(lo + chunk_size, vocab)
    run_max, run_sum, best, best_idx = _scan(
        base, lo, hi, temp, divisor, row_hash, SAMPLE, BLOCK, True, LOGPROBS
    )
    top, total, winner, token = _reduce(run_max, run_sum, best, best_idx, vocab)
    at = row * chunks + chunk
    plane = tl.num_programs(0) * chunks
    tl.store(stats_ptr + at, top)
    tl.store(stats_ptr + plane + at, total)
    tl.store(stats_ptr + 2 * plane + at, winner)
    tl.store(index_ptr + at, token)


@triton.jit
def _combine_kernel(
    logits_ptr, stride, temps_ptr, stats_ptr, index_ptr, tokens_ptr, logprobs_ptr, vocab, rows, chunks,
    SAMPLE: tl.constexpr, CHUNKS: tl.constexpr, LOGPROBS: tl.constexpr,
):  # fmt: skip
    """Program (row,): the row's chunks combined as ``_reduce`` combines lanes, then token and log-prob."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    if SAMPLE:
        temp = tl.load(temps_ptr + row)
    else:
        temp = 0.0
    divisor = tl.where(temp == 0.0, 1.0, temp)
    offs = tl.arange(0, CHUNKS)
    valid = offs < chunks
    at = row * chunks + offs
    plane = rows * chunks
    run_max = tl.load(stats_ptr + at, mask=valid, other=NO_MAX)
    run_sum = tl.load(stats_ptr + plane + at, mask=valid, other=0.0)
    best = tl.load(stats_ptr + 2 * plane + at, mask=valid, other=float("-inf"))
    best_idx = tl.load(index_ptr + at, mask=valid, other=vocab)
    top, total, _, token = _reduce(run_max, run_sum, best, best_idx, vocab)
    _finish(base, row, token, divisor, top, total, tokens_ptr, logprobs_ptr, LOGPROBS)


def split_chunks(rows: int, vocab: int, sms: int, block: int = SPLIT_BLOCK) -> int:
    """Chunks per row (a power of two): the fewest that give ``PROGRAMS_PER_SM`` programs per SM, but
    never chunks under ``MIN_BLOCKS_PER_CHUNK`` blocks. A pure function of the shapes: graph-safe."""
    most = max(1, vocab // (MIN_BLOCKS_PER_CHUNK * block))
    chunks = 1
    while chunks * 2 <= most and rows * chunks < PROGRAMS_PER_SM * sms:
        chunks *= 2
    return chunks


def fused_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
    chunks: int | None = None,
    block: int | None = None,
    logprobs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens int64 [rows], log-probs float32 [rows]); ``temperatures`` None: every row greedy.
    ``logprobs=False``: the same tokens, no log-probs computed (None; exact mode takes its own).

    ``chunks``: vocabulary chunks per row (None: ``split_chunks``; 1: the one-program-per-row kernel);
    ``block``: lanes per program (None: ``SPLIT_BLOCK``, or ``BLOCK`` for one chunk; a power of two)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    want_logprobs = logprobs
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device) if want_logprobs else None
    logprobs_out = tokens if logprobs is None else logprobs  # an unused pointer without log-probs
    if rows == 0:
        return tokens, logprobs
    sample = temperatures is not None
    if sample:  # the kernels read element ``row`` of each: they must be dense [rows] vectors
        temperatures, seeds, positions = (t.contiguous() for t in (temperatures, seeds, positions))
    else:  # unused pointers when every row is greedy
        temperatures = seeds = positions = tokens
    if chunks is None:
        chunks = split_chunks(rows, vocab, sm_count(logits.device), block or SPLIT_BLOCK)
    if chunks == 1:
        _sample_kernel[(rows,)](
            logits, logits.stride(0), temperatures, seeds, positions, tokens, logprobs_out, vocab,
            SAMPLE=sample, BLOCK=block or BLOCK, LOGPROBS=want_logprobs,
        )  # fmt: skip
        return tokens, logprobs
    block = block or SPLIT_BLOCK
    # Whole blocks per chunk; rounding up may leave fewer chunks than asked (none of them empty).
    chunk_size = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk_size)
    stats = torch.empty(3, rows, chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _partial_kernel[(rows, chunks)](
        logits, logits.stride(0), temperatures, seeds, positions, stats, index, vocab, chunk_size,
        SAMPLE=sample, BLOCK=block, LOGPROBS=want_logprobs, num_warps=SPLIT_WARPS,
    )  # fmt: skip
    _combine_kernel[(rows,)](
        logits, logits.stride(0), temperatures, stats, index, tokens, logprobs_out, vocab, rows, chunks,
        SAMPLE=sample, CHUNKS=triton.next_power_of_2(chunks), LOGPROBS=want_logprobs,
    )  # fmt: skip
    return tokens, logprobs
