"""The FP8 linear layers' GEMM at decode-sized token counts, in Triton (CUDA): ``out = (xq @ wq.T) * xs * ws
(+ bias)`` for e4m3 activations ``xq`` [M, K] quantized per token (scales ``xs`` [M, 1]) and e4m3 weights
``wq`` [N, K] quantized per output channel (scales ``ws`` [N, 1]), or both per 128-column block
(``xs`` [M, K/128], ``ws`` [N/128, K/128]: ``fp8_block``).

Why not only ``torch._scaled_mm``: on the H200 torch's row-wise FP8 GEMM took ~15 µs whatever the shape
at 32-256 tokens, and on a 7B's ``down_proj`` (N 3584, K 18944) it was slower than bf16 cuBLAS: with a
few hundred rows, 128 x 128 output tiles make a few dozen programs for 132 SMs and each walks all of K
(``bench/fp8_gemm.py``, docs/benchmarks.md). Here a launch may cut K into ``split_k`` ranges: each
program sums its range into a float32 workspace ``[split_k, M, N]`` and a second launch adds the ranges
in order, applies the scales and the bias, and writes the model dtype. Deterministic (no atomics), so an
FP8 engine's samples repeat for a seed.

Block scales vary along K, so a ``fp8_block`` launch scales each 128-column block's product before adding
it (``BLOCK_K`` 128); per-channel launches scale once, in the epilogue. Rows past M and columns past N are
masked (no token-count padding, which cuBLAS's block-wise GEMM needs). A ``tma`` launch loads its tiles
through tensor descriptors (Hopper's copy engine) where both operands allow it, else by pointers.

Which launch, and whether this kernel or ``torch._scaled_mm`` runs a product, is ``fp8_gemm_config``'s
decision (measured tiles per weight shape and token bucket, else a rule; no Triton needed to read it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.accel import tma_descriptor, tma_loadable
from tidal.rollout.quant.fp8 import BLOCK  # fp8_block's scale block: a block-scaled launch steps K by it
from tidal.rollout.quant.fp8_gemm_config import Fp8GemmConfig


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_am, stride_wn, stride_om, stride_split,
    stride_as_m, stride_as_k, stride_ws_n, stride_ws_k,
    HAS_BIAS: tl.constexpr, BLOCK_SCALED: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    # TMA: a_ptr and w_ptr are tensor descriptors (the copy engine loads the tiles; rows past M, columns
    # past N and the K tail read as zeros, as the masks make them); K ranges start at BLOCK_K multiples, so
    # a tile never crosses into the next range.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m  # row tiles of one column tile run next to each other: its weights stay in L2
    pid_n = pid // tiles_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * k_per
    k_end = tl.minimum(K, k_start + k_per)
    if not TMA:
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + (k_start + ks)[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_start + ks)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if TMA:
            a = a_ptr.load([pid_m * BLOCK_M, k0])
            w = w_ptr.load([pid_n * BLOCK_N, k0]).T
        else:
            inside = k0 + ks < k_end
            a = tl.load(a_ptrs, mask=(rows[:, None] < M) & inside[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(cols[None, :] < N) & inside[:, None], other=0.0)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if BLOCK_SCALED:  # this K block's scales, before its product joins the sum
            kb = k0 // BLOCK_K
            sa = tl.load(a_scale_ptr + rows * stride_as_m + kb * stride_as_k, mask=rows < M, other=0.0)
            sw = tl.load(
                w_scale_ptr + (cols // BLOCK_K) * stride_ws_n + kb * stride_ws_k, mask=cols < N, other=0.0
            )
            acc += tl.dot(a, w) * (sa[:, None] * sw[None, :])
        else:
            acc = tl.dot(a, w, acc)
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        if not BLOCK_SCALED:
            sa = tl.load(a_scale_ptr + rows * stride_as_m, mask=rows < M, other=0.0)
            sw = tl.load(w_scale_ptr + cols * stride_ws_n, mask=cols < N, other=0.0)
            acc = acc * sa[:, None] * sw[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # this K range's float32 sum; ``_reduce_kernel`` adds the ranges
        part = out_ptr + split.to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(part, acc, mask=out_mask)


@triton.jit
def _reduce_kernel(
    part_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_split, stride_om,
    stride_as_m, stride_ws_n, HAS_BIAS: tl.constexpr, BLOCK_SCALED: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = index < M * N
    row = index // N
    col = index % N
    acc = tl.load(part_ptr + index, mask=inside, other=0.0)
    for split in tl.static_range(1, SPLIT_K):  # the ranges in order: the same sum at every launch
        acc += tl.load(part_ptr + split * stride_split + index, mask=inside, other=0.0)
    if not BLOCK_SCALED:
        sa = tl.load(a_scale_ptr + row * stride_as_m, mask=inside, other=0.0)
        sw = tl.load(w_scale_ptr + col * stride_ws_n, mask=inside, other=0.0)
        acc = acc * sa * sw
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=inside)


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    config: Fp8GemmConfig,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_scaled: bool = False,
) -> torch.Tensor:
    """``xq`` [M, K] e4m3 (row-major) times ``wq`` [N, K] e4m3 (row-major) -> [M, N] in ``out_dtype``.
    Per-channel: ``xs`` [M, 1] and ``ws`` [N, 1] float32. ``block_scaled``: ``xs`` [M, K/128]
    (any strides) and ``ws`` [N/128, >= K/128] (padded columns allowed), ``config.block_k`` 128."""
    m, k = xq.shape
    n = wq.shape[0]
    if block_scaled and config.block_k != BLOCK:
        raise ValueError(f"fp8_gemm: block scales need block_k {BLOCK}, got {config.block_k}")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k)
    split = config.split_k > 1
    target = torch.empty((config.split_k, m, n), dtype=torch.float32, device=xq.device) if split else out
    tma = bool(config.tma) and tma_loadable(xq) and tma_loadable(wq)
    a, w = (xq, wq) if not tma else (
        tma_descriptor(xq, config.block_m, config.block_k), tma_descriptor(wq, config.block_n, config.block_k)
    )  # fmt: skip
    _fp8_gemm_kernel[grid](
        a, xs, w, ws, bias if bias is not None else ws, target,
        m, n, k, xq.stride(0), wq.stride(0), out.stride(0), m * n,
        xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1),
        HAS_BIAS=bias is not None and not split, BLOCK_SCALED=block_scaled, SPLIT_K=config.split_k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TMA=tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split:
        reduce_block = 1024
        _reduce_kernel[(triton.cdiv(m * n, reduce_block),)](
            target, xs, ws, bias if bias is not None else ws, out, m, n, m * n, out.stride(0),
            xs.stride(0), ws.stride(0), HAS_BIAS=bias is not None, BLOCK_SCALED=block_scaled,
            SPLIT_K=config.split_k, BLOCK=reduce_block, num_warps=4,
        )  # fmt: skip
    return out
