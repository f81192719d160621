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

``matmul``: ``x [M, K] @ w [N, K]^T`` with a launch (tile, K step, warps, stages) picked from the
weight's ``(N, K)`` only, never from ``M`` (``matmul_config``); float32 sums (bf16 or fp32 inputs; fp32 uses
IEEE products, not TF32), out in ``x``'s dtype. ``rms_norm``: one program per row. ``token_logprobs``:
``VOCAB_CHUNK`` slices of a row's vocabulary in parallel programs, each walked in ``VOCAB_BLOCK`` steps (max,
then sum of exponentials), their results combined in slice order by a second launch. ``attention``:
``QUERY_BLOCK`` (query, head) rows of one KV head per program (a decode step's GQA group reads its keys
once) over keys in ``KEY_BLOCK`` blocks at fixed absolute positions, online softmax in block order; a block a query sees none of leaves its state bit-unchanged
(alpha is exactly 1, it adds exact zeros), so the keys beyond a query's position, the other queries of its
tile and whether it is a prefill or a decode query change nothing. ``paged_attention``: the same kernel
reading the engine's paged KV cache in place through the block table (each key's slot computed from its
position): the same key blocks in the same order as over the gathered keys, so the same bits.

Keys and values beyond a query's position may hold anything finite (stale cache slots, padding).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tidal.rollout.kernels.exact_gemm_tuned import K_SPLITS, TUNED

# One configuration each (see the module doc): changing one changes results, never correctness. The GEMM's
# launch follows the weight's shape (``matmul_config``).
NORM_BLOCK = 1024
VOCAB_BLOCK = 2048
VOCAB_CHUNK = 8 * VOCAB_BLOCK  # vocabulary per log-softmax program (a 152k vocabulary: 10 per row)
QUERY_BLOCK, KEY_BLOCK = 32, 64


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
    own, start = [], 0
    for size in parts:
        w = weight[start : start + size]
        own.append(matmul(x, w, config=matmul_config(size, k, x.element_size()), parallel_split=False))
        start += size
    bits = torch.int16 if x.element_size() == 2 else torch.int32
    want = torch.cat(own, dim=1).view(bits)
    decode = decode_config(n, k, x.element_size())
    # a TMA launch also as pointer loads: what it runs where an operand is not TMA-loadable
    launches = [decode, replace(decode, tma=0)] if decode.tma else [decode]
    agree = all(
        torch.equal(matmul(x, weight, config=cfg, parallel_split=p).view(bits), want)
        for cfg in launches
        for p in (True, False)
    )
    if agree:
        _VERIFIED.add(_key(n, k, x))
    return agree


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
    tma = bool(c.tma) and _tma_loadable(x) and _tma_loadable(w)
    x_arg, w_arg = (_descriptor(x, c.block_m, c.block_k), _descriptor(w, c.block_n, c.block_k)) if tma else (x, w)
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


def _tma_loadable(t: torch.Tensor) -> bool:
    """A TMA descriptor can describe ``t`` (2-D, rows of unit stride, 16-byte aligned start and rows) on
    a GPU with the copy engine (Hopper and later)."""
    return (
        t.is_cuda
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        and torch.cuda.get_device_capability(t.device)[0] >= 9
    )


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [block_rows, block_cols])


# Reductions over a loaded row (norm, log-softmax) sum in an order set by the load's register layout, which
# Triton picks from the pointers' and strides' known alignment: not specialising on it keeps one order
# whatever the caller's tensors (a view at an odd offset included).
@triton.jit(do_not_specialize=["stride_x"], do_not_specialize_on_alignment=["x_ptr", "res_ptr"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, total_ptr, N: tl.constexpr, stride_x, stride_o, eps,
    BLOCK: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    # A float argument is float32 when Triton launches the kernel itself, float64 when torch.compile's
    # inductor does (the trainer's exact forward under --torch_compile): round it to float32 first, so
    # both add in float32 and give the same bits (no-op in the first case).
    eps = tl.full((), eps, tl.float32)
    offs = tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + offs
        x = _norm_input(x_ptr, res_ptr, total_ptr, row, c, N, stride_x, stride_o, dtype, RESIDUAL, True)
        squares += x * x
    inv = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / N + eps)
    for c0 in range(0, N, BLOCK):
        c = c0 + offs
        x = _norm_input(x_ptr, res_ptr, total_ptr, row, c, N, stride_x, stride_o, dtype, RESIDUAL, False)
        # the weight in the activations' dtype, as the engine (bf16 weights) holds it
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(dtype).to(tl.float32)
        y = x * inv
        if SCALE_IN_FLOAT32:
            out = w * y
        else:
            out = w * y.to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + c, out.to(dtype), mask=c < N)


@triton.jit
def _norm_input(
    x_ptr, res_ptr, total_ptr, row, c, N, stride_x, stride_o,
    dtype: tl.constexpr, RESIDUAL: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    """Columns ``c`` of the norm's input row, float32: ``x``, or with ``RESIDUAL`` the sum ``x + residual``
    rounded to the activations' dtype, as torch's add rounds it (stored to ``total`` when ``STORE``)."""
    x = tl.load(x_ptr + row * stride_x + c, mask=c < N, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + row * stride_x + c, mask=c < N, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if STORE:
            tl.store(total_ptr + row * stride_o + c, x, mask=c < N)
    return x.to(tl.float32)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale_in_float32: bool,
    residual: torch.Tensor | None = None,
):
    """RMSNorm of each row of ``x [..., N]`` (statistics in float32), out in ``x``'s dtype. With ``residual``
    (``x``'s shape and dtype): (the norm of ``x + residual``, that sum), the add in the same launch."""
    rows = x.reshape(-1, x.shape[-1])
    res = rows if residual is None else residual.reshape(rows.shape)
    if rows.stride(-1) != 1 or res.stride() != rows.stride():
        rows, res = rows.contiguous(), res.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight.contiguous(), out, total, rows.shape[1], rows.stride(0), out.stride(0),
            float(eps), BLOCK=NORM_BLOCK, SCALE_IN_FLOAT32=scale_in_float32, RESIDUAL=residual is not None,
            num_warps=4,
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), total.view(x.shape)


@triton.jit(do_not_specialize=["stride_l"], do_not_specialize_on_alignment=["logits_ptr"])
def _lse_part_kernel(
    logits_ptr, temp_ptr, part_ptr, V: tl.constexpr, stride_l, CHUNK: tl.constexpr, PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (row, part): the max and the sum of exponentials (from that max) of ``logits / T`` over the
    # part's vocabulary slice [part * CHUNK, (part + 1) * CHUNK), walked in BLOCK steps; stored for
    # ``_lse_finish_kernel``. The slices are set by V alone, never by the row count.
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    temp = tl.full((BLOCK,), 1.0, tl.float32) * tl.load(temp_ptr + row)
    offs = tl.arange(0, BLOCK)
    base = logits_ptr + row * stride_l
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    for v0 in range(part * CHUNK, part * CHUNK + CHUNK, BLOCK):
        c = v0 + offs
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, tl.math.div_rn(z, temp))
    m = tl.max(top, axis=0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(part * CHUNK, part * CHUNK + CHUNK, BLOCK):
        c = v0 + offs
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        zt = tl.math.div_rn(z, temp)
        # -inf logits (and the lanes past V) add nothing, also in a slice of only -inf (m = -inf)
        total += tl.where(zt > float("-inf"), tl.exp(zt - m), 0.0)
    tl.store(part_ptr + row * (2 * PARTS) + part, m)
    tl.store(part_ptr + row * (2 * PARTS) + PARTS + part, tl.sum(total, axis=0))


@triton.jit
def _lse_finish_kernel(
    logits_ptr, tokens_ptr, temp_ptr, part_ptr, out_ptr, stride_l, PARTS: tl.constexpr,
    PARTS_POW2: tl.constexpr,
):  # fmt: skip
    # Per row: the parts' sums rescaled to their common max and added in one fixed order, then the token's
    # log-prob.
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS_POW2)
    tops = tl.load(part_ptr + row * (2 * PARTS) + p, mask=p < PARTS, other=float("-inf"))
    sums = tl.load(part_ptr + row * (2 * PARTS) + PARTS + p, mask=p < PARTS, other=0.0)
    m = tl.max(tops, axis=0)
    lse = m + tl.log(tl.sum(tl.where(p < PARTS, sums * tl.exp(tops - m), 0.0), axis=0))
    token = tl.load(tokens_ptr + row)
    z_token = tl.load(logits_ptr + row * stride_l + token).to(tl.float32)
    tl.store(out_ptr + row, tl.math.div_rn(z_token, tl.load(temp_ptr + row)) - lse)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens`` (float32) per row of ``logits [..., V]``;
    ``temperature`` (float32) broadcasts against ``logits.shape[:-1]``. Each row's vocabulary is reduced in
    ``VOCAB_CHUNK`` slices by parallel programs (a decode step has too few rows to fill the GPU with one
    program a row), the slices' results combined in slice order."""
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    temps = temperature.to(torch.float32).expand(lead).reshape(-1).contiguous()
    toks = tokens.expand(lead).reshape(-1).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    vocab = rows.shape[1]
    parts = triton.cdiv(vocab, VOCAB_CHUNK)
    partials = torch.empty(rows.shape[0], 2 * parts, dtype=torch.float32, device=logits.device)
    if rows.shape[0]:
        _lse_part_kernel[(rows.shape[0], parts)](
            rows, temps, partials, vocab, rows.stride(0), CHUNK=VOCAB_CHUNK, PARTS=parts, BLOCK=VOCAB_BLOCK,
            num_warps=8,
        )  # fmt: skip
        _lse_finish_kernel[(rows.shape[0],)](
            rows, toks, temps, partials, out, rows.stride(0), PARTS=parts,
            PARTS_POW2=max(2, triton.next_power_of_2(parts)), num_warps=1,
        )  # fmt: skip
    return out.view(lead)


@triton.jit(do_not_specialize=["Lq", "Lk"])
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    bt_ptr,
    sbt,
    Lq,
    Lk,
    KV,
    scale,
    sqb,
    sql,
    sqh,
    sqd,
    skb,
    skl,
    skh,
    skd,
    svb,
    svl,
    svh,
    svd,
    spb,
    spl,
    sob,
    sol,
    soh,
    sod,
    GROUPS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    PAGE: tl.constexpr,
):  # WINDOW: the sliding window (0: none); PAGE: keys in a paged cache of PAGE-slot blocks (0: dense)
    # A tile's rows are (query, head) pairs of one KV head: row r is query r // GROUPS, head
    # kvh * GROUPS + r % GROUPS, so a decode step's GQA group shares one read of its keys.
    bkv = tl.program_id(1).to(tl.int64)
    b, kvh = bkv // KV, bkv % KV
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // GROUPS
    h = kvh * GROUPS + rows % GROUPS
    dims = tl.arange(0, BLOCK_D)
    live = qi < Lq
    dmask = dims < HEAD_DIM
    # a padding row (past the last query) sits at position -1: it sees no key
    pos = tl.load(pos_ptr + b * spb + qi * spl, mask=live, other=-1).to(tl.int32)
    q = tl.load(
        q_ptr + b * sqb + qi[:, None] * sql + h[:, None] * sqh + dims[None, :] * sqd,
        mask=live[:, None] & dmask[None, :],
        other=0.0,
    )
    # Key blocks [lo, hi): every block any row of the tile sees. The blocks outside it are ones each of
    # these rows sees nothing of, which would leave its state unchanged: skipping them is exact.
    # (Blocks past Lk, if a position were, are masked by ``kin``.)
    hi = tl.max(pos, axis=0) + 1
    lo = 0
    if WINDOW:
        first = tl.min(tl.where(live, pos, 2147483647), axis=0) - WINDOW + 1
        lo = (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N
    scale = tl.full((), scale, tl.float32)  # float64 under inductor (see _rms_norm_kernel)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + keys
        kin = kpos < Lk
        if PAGE:  # key j of row b: slot j % PAGE of cache block block_tables[b, j // PAGE]
            page = tl.load(bt_ptr + b * sbt + kpos // PAGE, mask=kin, other=0).to(tl.int64)
            slot = page * PAGE + kpos % PAGE
            k_rows, v_rows = slot * skl, slot * svl
        else:
            k_rows, v_rows = b * skb + kpos * skl, b * svb + kpos * svl
        k = tl.load(
            k_ptr + k_rows[None, :] + kvh * skh + dims[:, None] * skd,
            mask=kin[None, :] & dmask[:, None],
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        seen = (kpos[None, :] <= pos[:, None]) & kin[None, :]
        if WINDOW:
            seen &= kpos[None, :] > pos[:, None] - WINDOW
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # a row that sees nothing new keeps m: alpha exactly 1, and p is all exact zeros
        alpha = tl.where(m_new == m_i, 1.0, tl.exp(m_i - m_safe))
        p = tl.where(seen, tl.exp(s - m_safe[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + v_rows[:, None] + kvh * svh + dims[None, :] * svd,
            mask=kin[:, None] & dmask[None, :],
            other=0.0,
        )
        if IEEE:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + b * sob + qi[:, None] * sol + h[:, None] * soh + dims[None, :] * sod,
        out.to(o_ptr.dtype.element_ty),
        mask=live[:, None] & dmask[None, :],
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``batch_invariant.attention``'s contract (causal, GQA, optional sliding window; key ``j`` at
    position ``j``) on CUDA: ``q [B, Lq, H, D]``, ``k, v [B, Lk, KV, D]``, ``q_pos [B, Lq]`` ->
    ``[B, Lq, H, D]`` in ``q``'s dtype."""
    # no block table (PAGE=0 never reads it): q_pos stands in for its pointer
    return _launch_attention(q, k, v, k.stride(), v.stride(), k.shape[1], q_pos, q_pos, 0, 0, scale, window)


def paged_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``attention`` with row ``b``'s key ``j`` read in place from the paged cache ``layer_cache [2, blocks,
    page, KV, D]`` (keys, values) at slot ``j % page`` of block ``block_tables[b, j // page]``: the same
    key blocks in the same order as ``attention`` over the gathered ``[B, width * page, KV, D]`` keys, so
    the same bits, without the gathered copy (the block table's whole width per row, per layer)."""
    page = layer_cache.shape[2]
    keys, values = (layer_cache[i].flatten(0, 1) for i in (0, 1))  # [slots, KV, D]
    table = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    return _launch_attention(
        q, keys, values, (0, *keys.stride()), (0, *values.stride()), table.shape[1] * page,
        q_pos, table, table.stride(0), page, scale, window,
    )  # fmt: skip


def _launch_attention(q, k, v, k_strides, v_strides, lk, q_pos, table, table_stride, page, scale, window):
    """``_attention_kernel`` over ``q [B, Lq, H, D]`` with ``lk`` keys per row (``k``/``v``'s strides given:
    a paged cache has no batch stride)."""
    b, lq, h, d = q.shape
    kv = k.shape[-2]
    out = torch.empty(b, lq, h, d, dtype=q.dtype, device=q.device)
    if b * lq * h == 0:
        return out
    pos = q_pos.expand(b, lq)
    groups = h // kv
    grid = (triton.cdiv(lq * groups, QUERY_BLOCK), b * kv)
    _attention_kernel[grid](
        q, k, v, pos, out, table, table_stride, lq, lk, kv, float(scale),
        *q.stride(), *k_strides, *v_strides, *pos.stride(), *out.stride(),
        GROUPS=groups, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=QUERY_BLOCK,
        BLOCK_N=KEY_BLOCK, WINDOW=window or 0, IEEE=q.dtype == torch.float32, PAGE=page,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out
