"""Batch-invariant Triton kernels: ``--exact_logprobs`` on CUDA (``tidal.rollout.batch_invariant`` calls them).

cuBLAS picks a GEMM kernel (tile shape, split-K) from the problem's M, and torch's reduction kernels pick
their launch configuration from the number of rows, so a row's result there depends on what else is in
the batch. These kernels fix everything that decides a row's reduction order:

- one compiled configuration per kernel (the GEMM: per weight shape; no autotuning, and a K split only
  as that shape's configuration says); the row count ``M`` is neither specialised on
  (``do_not_specialize``) nor picks a configuration, so a 1-row decode and a 4k-row prefill compute the
  same sums;
- float32 accumulation, the reduced dimension walked in fixed blocks from 0 upward (a split GEMM's ranges
  each summed from zero, the sums added in range order, whether the ranges ran in parallel programs or
  in turn in one);
- a row's (or a query's) result is computed by instructions that read only that row: the other rows of
  its tile go through the same tensor-core instructions in other lanes, and masked rows are zeros.

This module: ``matmul``, ``x [M, K] @ w [N, K]^T`` with a launch (tile, K step, warps, stages, pointer or
TMA loads) picked from the weight's ``(N, K)`` only, never from ``M`` (``matmul_config``); float32 sums
(bf16 or fp32 inputs; fp32 uses IEEE products, not TF32), out in ``x``'s dtype. The others, imported
here so that callers find every exact kernel in one place: ``rms_norm`` and ``token_logprobs``
(``triton_exact_rows``), ``attention`` and ``paged_attention`` (``triton_exact_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tidal.accel import tma_descriptor, tma_loadable
from tidal.rollout.kernels.exact_gemm_tuned import K_SPLITS, TUNED
from tidal.rollout.kernels.triton_exact_attention import attention, paged_attention
from tidal.rollout.kernels.triton_exact_rows import rms_norm, token_logprobs

__all__ = [
    "MatmulConfig",
    "attention",
    "launch_keeps_bits",
    "matmul",
    "paged_attention",
    "rms_norm",
    "token_logprobs",
]


@triton.jit
def _k_range_sum(
    x_ptr, w_ptr, off_m, off_n, M, N, K: tl.constexpr, k_lo, k_hi,
    stride_xm, stride_xk, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    # One K range's float32 sum, from zero, in BLOCK_K steps upward: the unit a row's bits are made of.
    # TMA: x_ptr and w_ptr are tensor descriptors (the copy engine loads the tiles; what lies past M, N or
    # K reads as zeros, as the masks make it), else pointers.
    rows = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
    cols = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if TMA:
            a = x_ptr.load([off_m, k0])
            b = w_ptr.load([off_n, k0]).T
        else:
            k = k0 + ks
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                mask=(rows[:, None] < M) & (k[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
                mask=(cols[None, :] < N) & (k[:, None] < K),
                other=0.0,
            )
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _epilogue(acc, bias_ptr, out_ptr, rows, cols, M, N, stride_om, stride_on, HAS_BIAS: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    if HAS_BIAS:  # torch's separate ``out + bias``: the rounded product plus the bias in float32, rounded
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + bias[None, :]).to(dtype)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out, y, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M", "N", "k_split"])
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K: tl.constexpr,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    k_split, SPLITS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    # Tiles in groups of GROUP_M row tiles, so that neighbouring programs share weight columns in L2 (where
    # a tile runs changes nothing in it).
    pid, num_m, num_n = tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    rows = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
    cols = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
    # The K ranges' length ``k_split`` is a runtime value: with a compile-time one, a range of one K step
    # becomes a lone ``tl.dot`` from zero, which Triton folds into the add that follows (the running sum
    # as the dot's accumulator): another order of additions than the split sum's.
    if PARTIAL:  # axis 1 is the K range: its float32 sum into [SPLITS, M, N]; ``_split_sum_kernel`` adds them
        split = tl.program_id(1)
        acc = _k_range_sum(
            x_ptr, w_ptr, off_m, off_n, M, N, K, split * k_split, tl.minimum(split * k_split + k_split, K),
            stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, TMA,
        )  # fmt: skip
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=mask)
    elif SPLITS == 1:  # one range: its bounds known at compile time (a fully pipelined loop)
        acc = _k_range_sum(
            x_ptr, w_ptr, off_m, off_n, M, N, K, 0, K,
            stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, TMA,
        )  # fmt: skip
        _epilogue(acc, bias_ptr, out_ptr, rows, cols, M, N, stride_om, stride_on, HAS_BIAS)
    else:  # every K range in turn, each summed from zero, then added in range order (as the split sum)
        acc = _k_range_sum(
            x_ptr, w_ptr, off_m, off_n, M, N, K, 0, k_split,
            stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, TMA,
        )  # fmt: skip
        for s in tl.static_range(1, SPLITS):
            acc += _k_range_sum(
                x_ptr, w_ptr, off_m, off_n, M, N, K, s * k_split, tl.minimum(s * k_split + k_split, K),
                stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, TMA,
            )  # fmt: skip
        _epilogue(acc, bias_ptr, out_ptr, rows, cols, M, N, stride_om, stride_on, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "N"])
def _split_sum_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om, stride_on,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # The K ranges' sums of a tile, added in range order (0, 1, ...) in float32: what ``_matmul_kernel``
    # adds in one program, in the same order, so the same bits.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    acc = tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + (s * M + rows[:, None]) * N + cols[None, :], mask=mask, other=0.0)
    _epilogue(acc, bias_ptr, out_ptr, rows, cols, M, N, stride_om, stride_on, HAS_BIAS)


@dataclass(frozen=True)
class MatmulConfig:
    """A GEMM launch: the output tile (``block_m x block_n``), K's step (``block_k``), K cut into
    ``splits`` ranges (``k_split``; each summed from zero, the sums added in range order), warps,
    software-pipeline stages and the L2 grouping of row tiles (``group_m``: where a tile runs, not what it
    computes). Only the K partition (``k_split``) decides a column's bits (``matmul_config``)."""

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 64
    block_k: int = 64
    group_m: int = 8
    splits: int = 1
    tma: int = 0  # 1: the tiles are loaded by TMA (Hopper's copy engine) where the operands allow it

    def k_split(self, k: int) -> int:
        """The length of each K range: a multiple of ``SPLIT_ALIGN`` (so of any ``block_k`` dividing it:
        launches of other K steps cut K alike); the last range may be shorter."""
        return triton.cdiv(triton.cdiv(k, self.splits), SPLIT_ALIGN) * SPLIT_ALIGN


SPLIT_ALIGN = 128  # K ranges start at multiples of this (every K step used divides it)
# Weights with at most this many output features (0.5B's q/o/down_proj, 896; k/v_proj): 64-column tiles,
# twice the programs of 128-column ones (a decode step's M=256 is only 4 row tiles).
NARROW_N = 1024
LONG_K = 2048  # reductions at least this long (down_proj's intermediate size): one more stage in flight
# A split launch runs its K ranges in parallel programs (a second kernel adds their float32 sums) while
# its tiles leave SMs idle: up to this many tiles. Past it, one program walks every range in turn.
PARALLEL_SPLIT_TILES = 256
SPLIT_SUM_BLOCK = (32, 128)  # the split sum's tile
# GEMMs of at most this many rows (a decode step's batch) take their weight's decode launch, once
# ``verify_decode_launch`` has seen it give the trainer's launch's bits on this GPU.
DECODE_ROWS = 1024


def _tuned(n: int, k: int, itemsize: int, regime: str) -> MatmulConfig | None:
    entry = TUNED.get((n, k), {}) if itemsize == 2 else {}  # measured in bf16 (float32: more shared memory)
    fields = entry.get(regime)
    return None if fields is None else MatmulConfig(**fields, splits=K_SPLITS.get(k, 1))


def matmul_config(n: int, k: int, itemsize: int = 2) -> MatmulConfig:
    """The launch for a weight ``[n, k]`` of ``itemsize``-byte elements (the trainer's, and any row count's
    where no decode launch is verified): a function of the weight, NEVER of the row count M.

    A row's result is its K-reduction: per K range (``splits`` of them) ``tl.dot`` over ``block_k`` steps
    from 0 upward, each step one chain of MMA instructions on the row's lanes, whatever the tile's other
    rows hold, then the ranges' sums added in order. With the configuration fixed for a weight, that
    instruction sequence is the same for M=1 and M=16k, so the engine's decode (M=256) and the trainer's
    forward (M=16k) give a row the same bits by construction. Whether a split launch's ranges run in
    parallel programs or in turn in one changes nothing: each range is summed from zero and the sums are
    added in range order both ways. The K partition is a function of K alone (``K_SPLITS``), so every
    weight of one K is cut alike.

    Measured on an H200 (``bench/exact_tile_bits.py``): with the K partition fixed, a column's bits do not
    depend on the tile, the warps, the K step or the other columns of the launch either (each K step is a
    chain of 16-deep MMAs into the same float32 accumulator). That is what lets a decode step take another
    tile (``decode_config``) and pack q/k/v and gate/up into one launch; since it is a property of the
    GPU and compiler, not of the code, ``verify_decode_launch`` checks it on each weight before the
    engine relies on it. Shapes measured on an H200 take the best launches found (``exact_gemm_tuned``, by
    ``bench/exact_matmul.py``), the others this rule."""
    tuned = _tuned(n, k, itemsize, "train")
    if tuned is not None:
        return tuned
    block_n = 64 if n <= NARROW_N else 128
    splits = K_SPLITS.get(k, 1) if itemsize == 2 else 1
    return MatmulConfig(block_n=block_n, num_warps=4, num_stages=4 if k >= LONG_K else 3, splits=splits)


def decode_config(n: int, k: int, itemsize: int = 2) -> MatmulConfig:
    """The launch measured best for a weight ``[n, k]`` at a decode step's rows (``matmul_config``'s K
    partition, another tile), or ``matmul_config``'s where none is listed."""
    return _tuned(n, k, itemsize, "decode") or matmul_config(n, k, itemsize)


_VERIFIED: set[tuple] = set()  # (n, k, dtype, device) whose decode launch gives the trainer's bits


def _key(n: int, k: int, x: torch.Tensor) -> tuple:
    return n, k, x.dtype, x.device


def decode_launch_verified(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``verify_decode_launch`` passed for ``weight``'s shape in ``dtype`` on its device."""
    return (*weight.shape, dtype, weight.device) in _VERIFIED


def verify_decode_launch(
    n: int, k: int, dtype: torch.dtype, device: torch.device, parts: list[int] | None = None
) -> bool:
    """Whether ``decode_config``'s launch of a weight ``[n, k]`` gives every column the bits that
    ``matmul_config``'s launch gives it (of each part of ``parts`` alone where the weight packs several,
    as the engine's q/k/v: the trainer's separate layers), K ranges in parallel and in turn, on 64 seeded
    rows and a seeded weight in ``dtype`` on ``device``. Remembered: ``matmul`` then takes the decode launch
    for up to ``DECODE_ROWS`` rows of this shape. Not callable during a CUDA graph capture (it reads the
    result back)."""
    parts = parts or [n]
    g = torch.Generator(device=device).manual_seed(n * 65537 + k)
    x = torch.randn(64, k, generator=g, device=device).to(dtype)
    weight = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
    trains = [matmul_config(size, k, x.element_size()) for size in parts]
    agree = launch_keeps_bits(x, weight, parts, decode_config(n, k, x.element_size()), trains)
    if agree:
        _VERIFIED.add(_key(n, k, x))
    return agree


def launch_keeps_bits(
    x: torch.Tensor, weight: torch.Tensor, parts: list[int], decode: MatmulConfig, trains: list[MatmulConfig]
) -> bool:
    """Whether the launch ``decode`` of the packed ``weight`` gives ``x`` the bits that each part of
    ``parts`` gets alone from its launch in ``trains``, K ranges in parallel and in turn (a TMA launch
    also as pointer loads: what it runs where an operand is not TMA-loadable)."""
    own, start = [], 0
    for size, train in zip(parts, trains, strict=True):
        own.append(matmul(x, weight[start : start + size], config=train, parallel_split=False))
        start += size
    bits = torch.int16 if x.element_size() == 2 else torch.int32
    want = torch.cat(own, dim=1).view(bits)
    launches = [decode, replace(decode, tma=0)] if decode.tma else [decode]
    return all(
        torch.equal(matmul(x, weight, config=cfg, parallel_split=p).view(bits), want)
        for cfg in launches
        for p in (True, False)
    )


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: MatmulConfig | None = None,
    parallel_split: bool | None = None,
) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` in ``x``'s dtype (``w`` and ``bias [N]`` must have it too), each row on its
    own. ``bias`` is added in the epilogue exactly as torch's separate ``matmul(x, w) + bias`` adds it (the
    product rounded to the dtype, then the sum in float32, rounded): the same bits, one kernel fewer.
    ``out``: an ``[M, N]`` view to write into (a packed projection's columns), else a new tensor.
    ``config``: the launch (default: ``decode_config``'s up to ``DECODE_ROWS`` rows of a verified shape,
    ``verify_decode_launch``, else ``matmul_config``'s).
    ``parallel_split``: run a split launch's K ranges in parallel programs (default: while the launch has
    at most ``PARALLEL_SPLIT_TILES`` tiles, i.e. at decode sizes); the bits are the same either way."""
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if config is None and m <= DECODE_ROWS and _key(n, k, x) in _VERIFIED:
        config = decode_config(n, k, x.element_size())
    c = config or matmul_config(n, k, x.element_size())
    k_split = c.k_split(k)
    splits = triton.cdiv(k, k_split)
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    if parallel_split is None:
        parallel_split = tiles <= PARALLEL_SPLIT_TILES
    partial = splits > 1 and parallel_split
    bias_arg = out if bias is None else bias.contiguous()  # no bias: an unused pointer
    target = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else out
    tma = bool(c.tma) and tma_loadable(x) and tma_loadable(w)
    x_arg, w_arg = (
        (tma_descriptor(x, c.block_m, c.block_k), tma_descriptor(w, c.block_n, c.block_k)) if tma else (x, w)
    )
    _matmul_kernel[(tiles, splits if partial else 1)](
        x_arg, w_arg, bias_arg, target, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        k_split=k_split, SPLITS=splits, PARTIAL=partial,
        IEEE=x.dtype == torch.float32, HAS_BIAS=bias is not None, TMA=tma,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    if partial:
        bm, bn = SPLIT_SUM_BLOCK
        _split_sum_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            target, bias_arg, out, m, n, out.stride(0), out.stride(1),
            SPLITS=splits, BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=bias is not None, num_warps=4,
        )  # fmt: skip
    return out
