"""Fused sparse-MoE experts in Triton: the engine's ``expert_forward`` on CUDA (SiLU-gated experts).

The unfused path (``models/moe.py``) gathers every token/expert pair's row into a sorted copy, runs two
grouped GEMMs with the ``[pairs, 2 * intermediate]`` gate/up result, the activation and the weighted
down result each written and read back, then un-permutes. Here:

1. ``align_pairs`` (no host sync, so CUDA graphs can capture it) sorts the pairs by expert and
   pads each expert's run to a multiple of ``BLOCK_M``: ``sorted_pairs[i]`` is a pair index
   ``token * top_k + slot`` (``num_pairs`` marks padding) and ``block_expert[b]`` the expert of block
   ``b`` (-1 past the last). The buffers have a static size, the most padding ``num_pairs`` pairs can
   need, so the grid does not depend on the routing. Decode-sized inputs take one launch of
   ``_align_kernel`` (the ~15 small torch kernels of ``align_pairs_torch`` cost about a fifth of the
   experts' GEMM time per layer at decode); larger ones the torch ops, with bit-identical results.
2. ``_moe_gemm`` with ``GATED``: per (block of one expert's pairs, tile of ``intermediate``) it gathers
   the tokens' rows of ``x`` straight from ``x`` and multiplies them by the expert's gate and up weight
   tiles (each read once per block), then ``silu(gate) * up`` in float32 in the epilogue, stored once
   in the model dtype;
3. ``_moe_gemm`` without ``GATED``: the down projection of those rows, times the pair's routing weight in
   the epilogue, stored at the pair's own row (token order, so no un-permute);
4. the per-token sum of the k rows (a strided reduction in torch: deterministic, no atomics).

Before them, ``triton_route.fused_route`` (``moe.route`` on CUDA) computes the routing itself in one launch.

Numerics: products accumulate in float32 (tensor cores for 16-bit inputs, IEEE for float32); the gated
activation is rounded once instead of three times, otherwise the roundings are the unfused path's (the
pair outputs are stored in ``promote(x, weights)``: the model dtype for Qwen routers, float32 for
Mixtral's, and the k-sum is rounded to the model dtype). FP8 rollouts' e4m3 experts (``scales``) run W8A8
on FP8-capable GPUs: the launches' inputs quantized per row to e4m3 first, as the dense FP8 linears do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidal.accel import triton_usable


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of one launch; ``block_m`` also sets the padding of each expert's pairs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated activation: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, g = min(gate, limit)."""

    alpha: float
    limit: float


# Decode launches measured best on one H200 (``bench/moe_tiles.py``, 2026-12-02: gpt-oss-20b's, Qwen3.5-35B-A3B's
# and Qwen3-30B-A3B's experts at 256 tokens), per average pairs an expert gets (up to the key) and per weight
# format: (gated, down). Rows per block go one power of two above the average pairs, so that an expert with
# more than its share still fits one block (a second block reads its weights again).
_T = TileConfig
DECODE_TILES: dict[int, dict[bool, tuple[TileConfig, TileConfig]]] = {
    8: {False: (_T(16, 128, 128, 4, 2), _T(16, 128, 128, 4, 3)), True: (_T(16, 32, 256, 4, 3), _T(16, 64, 128, 4, 3))},
    16: {False: (_T(32, 64, 128, 4, 2), _T(32, 64, 128, 4, 3)), True: (_T(32, 128, 128, 4, 2), _T(32, 64, 128, 4, 3))},
    32: {False: (_T(64, 64, 64, 4, 3), _T(64, 128, 64, 4, 3)), True: (_T(64, 64, 64, 4, 3), _T(64, 128, 64, 4, 4))},
}  # fmt: skip
PREFILL_TILE = TileConfig(64, 128, 64, num_warps=8, num_stages=3)


def tile_configs(num_pairs: int, num_experts: int, fp8: bool = False) -> tuple[TileConfig, TileConfig]:
    """The (gated, down) launches for ``num_pairs`` token/expert pairs over ``num_experts`` experts, e4m3
    weights or not. Decode is bound by reading the weights: a block should hold all of an expert's pairs
    without much padding (``DECODE_TILES``, measured); prefill reuses each weight tile over larger blocks
    (``PREFILL_TILE``, untuned). The two launches share ``block_m`` (the alignment's padding)."""
    rows_per_expert = num_pairs / num_experts
    for bound, by_format in DECODE_TILES.items():
        if rows_per_expert <= bound:
            return by_format[fp8]
    return PREFILL_TILE, PREFILL_TILE


@dataclass
class AlignedPairs:
    """Token/expert pairs sorted by expert, each expert's run padded to a multiple of ``block_m``."""

    sorted_pairs: torch.Tensor  # [capacity] int32: pair index token * top_k + slot; num_pairs = padding
    block_expert: torch.Tensor  # [capacity // block_m] int32: expert of each block, -1 = unused block
    num_pairs: int


def padded_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the padded layout can need: each of at most min(pairs, experts) non-empty experts
    pads by at most ``block_m - 1`` rows."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def align_pairs_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Sort and pad the pairs of ``ids`` [tokens, k] (expert ids) by expert; torch ops without a host
    sync (the counts stay on the device). The reference of ``align_pairs_triton`` and the path for
    inputs larger than its limits."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=device) - count_start[sorted_experts]
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    # The expert whose padded run holds the block's first row; past the last run: num_experts -> -1.
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return AlignedPairs(sorted_pairs, block_expert, num_pairs)


# The single-program alignment kernel holds every pair in registers: decode sizes (B=512 at top-8) and
# up to 1024 experts; larger inputs take the torch ops.
ALIGN_KERNEL_MAX_PAIRS = 4096
ALIGN_KERNEL_MAX_EXPERTS = 1024


def align_kernel_fits(num_pairs: int, num_experts: int) -> bool:
    """``_align_kernel`` handles this many pairs and experts (an empty routing needs no kernel)."""
    return 0 < num_pairs <= ALIGN_KERNEL_MAX_PAIRS and num_experts <= ALIGN_KERNEL_MAX_EXPERTS


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Sort and pad the pairs of ``ids`` [tokens, k] (expert ids) by expert, without a host sync: one
    Triton launch where it fits, else torch ops (the same result, bit for bit)."""
    if triton_usable(ids) and align_kernel_fits(ids.numel(), num_experts):
        return align_pairs_triton(ids, num_experts, block_m)
    return align_pairs_torch(ids, num_experts, block_m)


def align_pairs_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """``align_pairs_torch`` in one launch of ``_align_kernel`` (one program: the inputs are decode-sized)."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    if not align_kernel_fits(num_pairs, num_experts):
        raise ValueError(
            f"triton_moe.align_pairs_triton: {num_pairs} pairs over {num_experts} experts; the kernel takes "
            f"1..{ALIGN_KERNEL_MAX_PAIRS} pairs and at most {ALIGN_KERNEL_MAX_EXPERTS} experts"
        )
    capacity = padded_capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=flat.device)
    # Powers of two for tl.arange; at least one element per thread (128 threads) for the pairs, whole
    # warps of bins for tl.histogram's lowering. Few variants compile: 6 pair sizes per expert count.
    pairs = max(128, triton.next_power_of_2(num_pairs))
    experts = max(32, triton.next_power_of_2(num_experts))
    # The [rows, experts] comparisons stay near 4096 elements (registers, no spills).
    tile = max(1, 4096 // experts)
    _align_kernel[(1,)](
        flat,
        sorted_pairs,
        block_expert,
        num_pairs,
        capacity,
        capacity // block_m,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        PAIRS=pairs,
        EXPERTS=experts,
        BLOCKS=min(64, tile),
        PAD_COLS=min(block_m, tile),
        FILL=1024,
        num_warps=4 if pairs <= 1024 else 8,
    )
    return AlignedPairs(sorted_pairs, block_expert, num_pairs)


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    capacity,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCKS: tl.constexpr,
    PAD_COLS: tl.constexpr,
    FILL: tl.constexpr,
):
    """``align_pairs_torch`` in one program. Every row of ``sorted_pairs`` is written exactly once (a
    pair's row, its expert's padding, or the tail past the last run), so no store can overwrite another
    and no barrier is needed; nothing written is read back.

    Pairs are sorted by the key ``expert * PAIRS + pair`` (unique keys: the order within an expert is
    the pairs' order, as a stable sort gives); the i-th sorted pair goes to row i plus the padding of
    the runs before its expert."""
    pair = tl.arange(0, PAIRS)
    expert_of_pair = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
    # Lanes past num_pairs (and ids out of range, which the torch path would reject) take no row.
    real = (expert_of_pair >= 0) & (expert_of_pair < NUM_EXPERTS)
    counts = tl.histogram(expert_of_pair, EXPERTS, mask=real)  # bins past NUM_EXPERTS stay 0
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, 0)
    pad = padded - counts
    pad_before = tl.cumsum(pad, 0) - pad

    key = tl.sort(tl.where(real, expert_of_pair, NUM_EXPERTS) * PAIRS + pair)
    sorted_expert = key // PAIRS
    shift = tl.gather(pad_before, tl.minimum(sorted_expert, EXPERTS - 1), 0)
    tl.store(sorted_pairs_ptr + pair + shift, key % PAIRS, mask=sorted_expert < NUM_EXPERTS)

    # Each expert's padding: rows [end - pad, end), fewer than BLOCK_M.
    pad_value = tl.zeros([EXPERTS, PAD_COLS], dtype=tl.int32) + num_pairs
    for col0 in tl.static_range(0, BLOCK_M, PAD_COLS):
        col = col0 + tl.arange(0, PAD_COLS)
        rows = (run_end - pad)[:, None] + col[None, :]
        tl.store(sorted_pairs_ptr + rows, pad_value, mask=col[None, :] < pad[:, None])
    # The tail past the last run.
    total = tl.sum(padded, 0)
    tail_value = tl.zeros([FILL], dtype=tl.int32) + num_pairs
    for row0 in range(0, capacity, FILL):
        row = row0 + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + row, tail_value, mask=(row >= total) & (row < capacity))

    # A block's expert: how many runs end at or before its first row (searchsorted right); all of them
    # (NUM_EXPERTS) means past the last run: -1. The power-of-two padding experts never count.
    expert = tl.arange(0, EXPERTS)
    run_end = tl.where(expert < NUM_EXPERTS, run_end, 2147483647)
    for block0 in range(0, num_blocks, BLOCKS):
        block = block0 + tl.arange(0, BLOCKS)
        before = (run_end[None, :] <= (block * BLOCK_M)[:, None]).to(tl.int32)
        owner = tl.sum(before, 1)
        tl.store(block_expert_ptr + block, tl.where(owner < NUM_EXPERTS, owner, -1), mask=block < num_blocks)


@triton.jit
def _moe_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    route_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    N,
    K: tl.constexpr,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    scale_ptr,
    stride_se,
    a_scale_ptr,
    bias_ptr,
    stride_be,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    W_SCALED: tl.constexpr,
    A_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One (block of ``BLOCK_M`` padded rows of one expert, ``BLOCK_N`` output columns) tile.

    ``GATED``: rows of ``a`` are tokens (``pair // TOP_K``), the weight holds gate rows [0, N) then up
    rows [N, 2N), out[row] = silu(gate) * up at the padded row. Else: rows of ``a`` are padded rows,
    out[pair] = routing weight * (a @ w.T). Weight and ``a`` rows are contiguous along K.

    ``W_SCALED`` (FP8 rollouts, ``tidal.rollout.quant``): the weight is e4m3, widened to ``a``'s dtype
    (exactly) tile by tile, and the float32 accumulator is multiplied by each output channel's scale
    (``scale_ptr`` [E, rows of the weight], ``stride_se`` per expert) before the epilogue.
    ``A_SCALED`` (with ``W_SCALED``; W8A8): ``a`` is e4m3 too, with one float32 scale per row of ``a``
    (``a_scale_ptr``, indexed like ``a``: the token for ``GATED``, else the padded row); the e4m3 tiles go
    to ``tl.dot`` as they are (FP8 MMA, float32 accumulator) and the accumulator is multiplied by
    ``a_scale[row] * w_scale[col]``. Rows of padding load 0 and scale 0 (never stored).

    ``HAS_BIAS`` (gpt-oss): each expert's bias (``bias_ptr`` [E, rows of the weight]) is added to the
    float32 accumulator (after the scale), before the activation or the routing weight.
    ``CLAMPED_SWIGLU`` (gpt-oss): the gated activation is ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``
    with ``g = min(gate, limit)`` instead of ``silu(gate) * up``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    valid = pairs < num_pairs
    if GATED:
        a_rows = pairs // TOP_K
    else:
        a_rows = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    w_ptrs = w_base + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if W_SCALED and not A_SCALED:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if W_SCALED and not A_SCALED:
                w_up = w_up.to(a.dtype)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALED:
        scale_base = scale_ptr + expert.to(tl.int64) * stride_se
        scale = tl.load(scale_base + cols, mask=col_ok, other=0.0)[None, :]
        if GATED:
            scale_up = tl.load(scale_base + N + cols, mask=col_ok, other=0.0)[None, :]
        if A_SCALED:  # W8A8: the row's activation scale times the channel's
            a_scale = tl.load(a_scale_ptr + a_rows, mask=valid, other=0.0)[:, None]
            scale = a_scale * scale
            if GATED:
                scale_up = a_scale * scale_up
        acc = acc * scale
        if GATED:
            acc_up = acc_up * scale_up
    if HAS_BIAS:
        bias_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc = acc + tl.load(bias_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up = acc_up + tl.load(bias_base + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # sigmoid(z) = 1 / (1 + e^-z), written with builtins (the interpreter cannot call tl.sigmoid, a
        # jit function, once triton was imported without TRITON_INTERPRET).
        if CLAMPED_SWIGLU:
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            result = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            result = acc / (1.0 + tl.exp(-acc)) * acc_up
        out_rows = rows
    else:
        route = tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        result = acc * route[:, None]
        out_rows = pairs
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _launch(
    a, w, out, route, aligned: AlignedPairs, top_k: int, gated: bool, cfg: TileConfig, scale=None, bias=None,
    swiglu: ClampedSwiGLU | None = None, a_scale=None,
) -> None:  # fmt: skip
    """``scale``: an e4m3 ``w``'s per-output-channel scales [E, rows] (FP8 rollouts), None otherwise;
    ``bias``: the experts' biases [E, rows]; ``swiglu``: gpt-oss's clamped gated activation (gated only);
    ``a_scale``: an e4m3 ``a``'s per-row scales [rows of a, 1] (W8A8, with ``scale``)."""
    if a_scale is not None and (scale is None or a.dtype != torch.float8_e4m3fn or cfg.block_k < 32):
        raise ValueError(  # FP8 tl.dot takes K tiles of 32 or more
            f"triton_moe: activation scales need e4m3 activations, e4m3 (scaled) weights and block_k >= 32 ({cfg})"
        )
    n = w.shape[1] // 2 if gated else w.shape[1]
    grid = (aligned.block_expert.numel(), triton.cdiv(n, cfg.block_n))
    _moe_gemm[grid](
        a,
        w,
        out,
        route,
        aligned.sorted_pairs,
        aligned.block_expert,
        n,
        w.shape[2],
        aligned.num_pairs,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        route if scale is None else scale,  # an unused pointer when the weight is not scaled
        0 if scale is None else scale.stride(0),
        route if a_scale is None else a_scale.reshape(-1),  # one scale per row of a (contiguous)
        route if bias is None else bias,  # unused without a bias
        0 if bias is None else bias.stride(0),
        1.0 if swiglu is None else float(swiglu.alpha),
        0.0 if swiglu is None else float(swiglu.limit),
        TOP_K=top_k,
        GATED=gated,
        W_SCALED=scale is not None,
        A_SCALED=a_scale is not None,
        HAS_BIAS=bias is not None,
        CLAMPED_SWIGLU=swiglu is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def fused_expert_forward(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: TileConfig | tuple[TileConfig, TileConfig] | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    swiglu: ClampedSwiGLU | None = None,
    quantize_activations: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])) with e = ids[t, k]; x [T, H] -> [T, H].

    ``config``: one launch for both GEMMs or a (gated, down) pair; None: ``tile_configs``.
    ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I], as ``moe.Experts`` stores them.
    ``scales``: the two weights are e4m3 with these per-output-channel scales, [E, 2I] and [E, H] float32
    (FP8 rollouts: ``tidal.rollout.quant``). gpt-oss's experts: ``biases`` [E, 2I] and [E, H] added to each
    projection (the down one before the routing weight, as transformers adds it) and ``swiglu``, its clamped
    activation in place of SiLU.

    ``quantize_activations`` (with ``scales``): W8A8, the dense FP8 linears' recipe. It is the per-row e4m3
    quantizer, ``a`` [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): ``quant/triton_fp8.quantize_rows_triton``,
    one launch, passed in rather than imported (``tidal.rollout.quant`` imports ``models.moe``, which imports
    this module, and tests/test_imports.py keeps even call-time imports acyclic). Applied to ``x`` and to the
    gated output (computed and rounded in ``x``'s dtype); the GEMMs then run on FP8 tensor cores
    (sm89+), both scales applied to the float32 accumulator. None: W8A16, the e4m3 weight tiles widened to
    ``x``'s dtype (exact), the activations as they are. The engine's FP8 experts run W8A8
    (``quant/experts.py``: that mode needs an sm89+ GPU)."""
    num_tokens, top_k = ids.shape
    num_experts, double_inter, hidden = gate_up_proj.shape
    if num_tokens == 0:  # nothing to route (the allocations below would be empty)
        return torch.zeros_like(x)
    x, gate_up_proj, down_proj = x.contiguous(), gate_up_proj.contiguous(), down_proj.contiguous()
    if quantize_activations is not None and scales is None:
        raise ValueError("fused_expert_forward: quantize_activations needs e4m3 weights (scales)")
    if config is None:
        config = tile_configs(num_tokens * top_k, num_experts, fp8=scales is not None)
    gated_cfg, down_cfg = (config, config) if isinstance(config, TileConfig) else config
    if gated_cfg.block_m != down_cfg.block_m:
        raise ValueError(f"fused_expert_forward: the two launches' block_m differ ({gated_cfg} / {down_cfg})")
    aligned = align_pairs(ids, num_experts, gated_cfg.block_m)
    route = weights.reshape(-1).contiguous()
    inter = x.new_empty(aligned.sorted_pairs.numel(), double_inter // 2)
    gate_up_scale, down_scale = scales if scales is not None else (None, None)
    gate_up_bias, down_bias = (b.contiguous() for b in biases) if biases is not None else (None, None)
    a, a_scale = (x, None) if quantize_activations is None else quantize_activations(x)
    _launch(
        a, gate_up_proj, inter, route, aligned, top_k, True, gated_cfg, gate_up_scale, gate_up_bias, swiglu,
        a_scale,
    )  # fmt: skip
    out = x.new_empty(num_tokens * top_k, hidden, dtype=torch.promote_types(x.dtype, weights.dtype))
    # W8A8: every padded row is quantized (which rows are padding is known on the device only); rows of
    # padding hold whatever the allocation held, maybe NaN scales, but the down launch masks them on load.
    a, a_scale = (inter, None) if quantize_activations is None else quantize_activations(inter)
    _launch(a, down_proj, out, route, aligned, top_k, False, down_cfg, down_scale, down_bias, None, a_scale)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
