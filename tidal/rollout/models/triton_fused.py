"""Fused Triton kernels for the decoder's element-wise work (CUDA only; ``layers.py`` falls back to torch).

The kernels are bit-equal to the torch ops they replace (the contract: greedy parity with transformers
must not move), so every rounding of the torch path is reproduced in the kernel:

- ``silu_and_mul``: ``F.silu(gate) * up`` over the packed ``gate_up`` projection ([T, 2I] -> [T, I]).
  torch's CUDA SiLU computes ``x / (1 + exp(-x))`` in float32 and rounds once to the model dtype; the mul
  rounds the float32 product of the two model-dtype values once more. The kernel uses libdevice's
  ``expf`` (what nvcc links for ``::exp``; without flush-to-zero, as torch is built) and an IEEE
  division (``div_rn``), not Triton's approximate defaults; contraction as nvcc's (``SILU_CONTRACT``).
- ``silu_and_mul_fp8``: the same values, and in the same launch their e4m3 rows and per-token scales for
  an FP8 ``down_proj`` (FP8 rollouts), bit-equal to ``quant/triton_fp8.py``'s launch on the output (the same
  ``kernels/triton_e4m3`` helpers); one program per row, as the scale needs the row's maximum.
- ``rope_store_kv``: RoPE on the q and k heads (rotate-half layout), optionally after Qwen3's per-head
  q/k RMSNorm, and the store of k/v into the paged KV cache at ``slot_mapping``. It replaces the two
  norms' copies, ``apply_rope``'s ~6 ops and ``store_kv``'s two ``index_copy_``. torch rounds each
  product ``x * cos``, ``rot * sin`` and their sum to the model dtype; the kernel does the same, with
  ``mul_rn`` / ``add_rn`` so that float32 models do not get a fused multiply-add either. The norm is
  ``triton_norm``'s arithmetic (same expression, same 1-D layout: 4 warps over one head) because that
  kernel is what the unfused path runs on CUDA; only for head_dim > 32 (``layers.fusable_head_norm``).
  Without the norms a program takes ``ROPE_HEADS`` heads of a token (the arithmetic is element-wise, plus
  an FP8 row's maximum, so the layout does not change the bits); with them, one head, laid out as
  ``triton_norm`` lays it (its sum of squares must reduce in the same order).

Triton's interpreter (CPU tests, ``TRITON_INTERPRET=1``) has no libdevice; there numpy's float32 ops
are already exactly rounded and the plain operators are used instead.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from tidal.rollout.kernels.triton_e4m3 import e4m3_scale, store_e4m3_row, to_e4m3

_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# Whether ptxas/LLVM may contract SiLU's ``1 + expf(-x)`` into a fused multiply-add (expf ends in a
# multiply), as nvcc's default ``--fmad=true`` allows when it builds torch's kernel. The gpu tests check
# both settings against torch, so a torch build that differs shows which one it needs.
SILU_CONTRACT = True


@triton.jit
def _mul_rn(a, b):
    if _INTERPRETED:
        out = a * b
    else:
        out = libdevice.mul_rn(a, b)
    return out


@triton.jit
def _add_rn(a, b):
    if _INTERPRETED:
        out = a + b
    else:
        out = libdevice.add_rn(a, b)
    return out


@triton.jit
def _silu(x):
    """torch's CUDA SiLU in float32: x / (1 + expf(-x)), IEEE division."""
    if _INTERPRETED:
        out = x / (1.0 + tl.exp(-x))
    else:
        out = tl.math.div_rn(x, 1.0 + libdevice.exp(-x))
    return out


@triton.jit
def rope_half(x, xp, c, s, first_half):
    """``apply_rope`` (rotate-half layout) of ``x`` in the model dtype, rounded as torch rounds it: ``xp``
    holds each lane's rotate-half partner (lane d +/- head_dim / 2), ``c``/``s`` cos and sin in float32,
    ``first_half`` the lanes below head_dim / 2. Shared by ``_rope_store_kv_kernel`` and the fused decode
    attention (``triton_attention``), so both produce the same bits."""
    # torch negates (-0.0 for +0.0); Triton's unary minus is 0 - x, so multiply by -1 instead.
    rot = tl.where(first_half, xp.to(tl.float32) * -1.0, xp.to(tl.float32))
    # apply_rope: x * cos and rot * sin each rounded to the model dtype, then their rounded sum.
    a = _mul_rn(x.to(tl.float32), c).to(x.dtype).to(tl.float32)
    b = _mul_rn(rot, s).to(x.dtype).to(tl.float32)
    return _add_rn(a, b).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    act = _silu(gate.to(tl.float32)).to(gate.dtype)  # F.silu's output, in the model dtype
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)  # nothing to contract it with
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``: [T, 2I] -> [T, I], one kernel."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(width))
    flat = gate_up.reshape(rows, gate_up.shape[-1])  # a view for the [T, 2I] projection output
    _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
        flat,
        out,
        width,
        flat.stride(0),
        BLOCK=block,
        num_warps=4 if block >= 512 else 2,
        enable_fp_fusion=SILU_CONTRACT,
        enable_reflect_ftz=False,  # libdevice without flush-to-zero, as torch's kernels are built
    )
    return out


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, out_ptr, q_ptr, s_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    """One program per row (the scale needs the whole row's maximum): a first pass computes and stores the
    products and finds their maximum; after a barrier (the stores visible to the whole program) a second
    pass reads them back, from cache, and stores their e4m3 values."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    src = x_ptr + row * stride_x
    dst = out_ptr + row * n_cols
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        gate = tl.load(src + start + cols, mask=mask, other=0.0)
        up = tl.load(src + n_cols + start + cols, mask=mask, other=0.0)
        act = _silu(gate.to(tl.float32)).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(dst + start + cols, out, mask=mask)
        amax = tl.maximum(amax, tl.abs(out.to(tl.float32)))
    scale = e4m3_scale(tl.max(amax, 0))
    tl.store(s_ptr + row, scale)
    tl.debug_barrier()
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        out = tl.load(dst + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * n_cols + start + cols, to_e4m3(out, scale), mask=mask)


# (BLOCK, num_warps) of ``silu_and_mul_fp8``'s one program per row, by the row's width (bench/fp8_fused_quant.py
# compares launches; H200, 256 rows). Wide rows: 7B (18,944) 10.9 µs, against 15.3 for 2048 x 8 and 30 for
# the whole row in registers (32768 x 32). Narrow rows: 0.5B (4,864) 4.6 µs against 6.2 for 4096 x 16,
# whose second block is mostly masked.
SILU_FP8_WIDE = (4096, 16)
SILU_FP8_NARROW = (1024, 8)
SILU_FP8_WIDE_FROM = 8192  # columns
SILU_FP8_LAUNCH: tuple[int, int] | None = None  # one launch for every width (the bench times several)


def silu_fp8_launch(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of ``silu_and_mul_fp8`` for rows of ``width`` columns."""
    if SILU_FP8_LAUNCH is not None:
        return SILU_FP8_LAUNCH
    return SILU_FP8_WIDE if width >= SILU_FP8_WIDE_FROM else SILU_FP8_NARROW


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``silu_and_mul`` that also quantizes each output row for an FP8 linear layer, in the same launch:
    (out [T, I], (e4m3 [T, I], float32 scales [T, 1])), the e4m3 values and scales bit-equal to
    ``triton_fp8.quantize_rows_triton(out)``."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    q = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows == 0:
        return out, (q, scales)
    flat = gate_up.reshape(rows, gate_up.shape[-1])
    block, warps = silu_fp8_launch(width)
    _silu_and_mul_fp8_kernel[(rows,)](
        flat,
        out,
        q,
        scales,
        width,
        flat.stride(0),
        BLOCK=min(block, triton.next_power_of_2(width)),
        num_warps=warps,
        enable_fp_fusion=SILU_CONTRACT,
        enable_reflect_ftz=False,
    )
    return out, (q, scales)


@triton.jit
def _rope_store_kv_kernel(
    qk_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    scales_ptr,
    slot_ptr,
    stride_qk_t,
    stride_qk_h,
    stride_v_t,
    stride_v_h,
    stride_cos,
    v_cache_offset,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    HAS_CACHE: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # With Qwen3's per-head q/k norms (``_rope_store_kv_heads_kernel`` without them). One program per
    # (token, head), 4 warps over the head as triton_norm lays it out: heads [0, H) are q, [H, H + KV) are
    # k, [H + KV, H + 2 KV) are v.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    half = head_dim // 2
    if h < num_heads + num_kv_heads:
        partner = tl.where(cols < half, cols + half, cols - half)
        src = qk_ptr + t * stride_qk_t + h * stride_qk_h
        x = tl.load(src + cols, mask=mask, other=0.0)
        xp = tl.load(src + partner, mask=mask, other=0.0)
        # triton_norm's arithmetic over this head (its partner half is normalised by the same factor).
        if h < num_heads:
            w_ptr = q_weight_ptr
        else:
            w_ptr = k_weight_ptr
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, 0) / head_dim + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
        x = (w * (x32 * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
        xp = (wp * (xp.to(tl.float32) * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
        c = tl.load(cos_ptr + t * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
        out = rope_half(x, xp, c, s, cols < half)
        if h < num_heads:
            tl.store(q_out_ptr + (t * num_heads + h) * head_dim + cols, out, mask=mask)
        else:
            kh = h - num_heads
            tl.store(k_out_ptr + (t * num_kv_heads + kh) * head_dim + cols, out, mask=mask)
            if HAS_CACHE:
                row = tl.load(slot_ptr + t).to(tl.int64) * num_kv_heads + kh
                if FP8:  # an FP8 cache (runner/kv_cache.py): e4m3 row, its scale beside
                    store_e4m3_row(cache_ptr + row * head_dim + cols, scales_ptr + row, out, mask)
                else:
                    tl.store(cache_ptr + row * head_dim + cols, out, mask=mask)
    else:
        if HAS_CACHE:
            vh = h - num_heads - num_kv_heads
            v = tl.load(v_ptr + t * stride_v_t + vh * stride_v_h + cols, mask=mask, other=0.0)
            row = tl.load(slot_ptr + t).to(tl.int64) * num_kv_heads + vh
            if FP8:  # the v half of the scales starts v_cache_offset / head_dim rows in
                v_scales = scales_ptr + v_cache_offset // head_dim + row
                store_e4m3_row(cache_ptr + v_cache_offset + row * head_dim + cols, v_scales, v, mask)
            else:
                tl.store(cache_ptr + v_cache_offset + row * head_dim + cols, v, mask=mask)


@triton.jit
def _rope_store_kv_heads_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, cache_ptr, scales_ptr, slot_ptr,
    stride_qk_t, stride_qk_h, stride_v_t, stride_v_h, stride_cos, v_cache_offset,
    num_heads, num_kv_heads, head_dim,
    HAS_CACHE: tl.constexpr, FP8: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # ``_rope_store_kv_kernel`` without per-head norms, ``HEADS`` heads a program ([HEADS, BLOCK] tiles):
    # one head a program left a decode step's launch (256 tokens x 36 heads at 7B) at ~7 µs, mostly
    # program overhead. The arithmetic is element-wise (and a row's maximum for FP8), so the bits are
    # the per-head kernel's.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    cols = tl.arange(0, BLOCK)[None, :]
    half = head_dim // 2
    lanes = cols < head_dim
    is_q = h < num_heads
    is_k = (h >= num_heads) & (h < num_heads + num_kv_heads)
    is_v = (h >= num_heads + num_kv_heads) & (h < num_heads + 2 * num_kv_heads)
    qk_src = qk_ptr + t * stride_qk_t + h * stride_qk_h
    partner = tl.where(cols < half, cols + half, cols - half)
    x = tl.load(qk_src + cols, mask=(is_q | is_k) & lanes, other=0.0)
    xp = tl.load(qk_src + partner, mask=(is_q | is_k) & lanes, other=0.0)
    c = tl.load(cos_ptr + t * stride_cos + cols, mask=lanes, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_cos + cols, mask=lanes, other=0.0).to(tl.float32)
    out = rope_half(x, xp, c, s, cols < half)
    tl.store(q_out_ptr + (t * num_heads + h) * head_dim + cols, out, mask=is_q & lanes)
    kh = h - num_heads
    tl.store(k_out_ptr + (t * num_kv_heads + kh) * head_dim + cols, out, mask=is_k & lanes)
    if HAS_CACHE:
        vh = h - num_heads - num_kv_heads
        v = tl.load(v_ptr + t * stride_v_t + vh * stride_v_h + cols, mask=is_v & lanes, other=0.0)
        row = tl.load(slot_ptr + t).to(tl.int64) * num_kv_heads + tl.where(is_k, kh, vh)
        dst = row * head_dim + cols + tl.where(is_v, v_cache_offset, 0)
        vals = tl.where(is_k, out, v)
        kv = (is_k | is_v) & lanes
        if FP8:  # store_e4m3_row's arithmetic, a row (a head) at a time
            x32 = vals.to(tl.float32)
            scale = e4m3_scale(tl.max(tl.where(kv, tl.abs(x32), 0.0), 1))[:, None]
            tl.store(cache_ptr + dst, to_e4m3(x32, scale), mask=kv)
            scale_row = row + tl.where(is_v, v_cache_offset // head_dim, 0)
            tl.store(scales_ptr + scale_row, scale, mask=is_k | is_v)
        else:
            tl.store(cache_ptr + dst, vals, mask=kv)


# Heads a program of ``_rope_store_kv_heads_kernel``: 7B's 28 + 4 + 4 heads in 5 programs a token.
ROPE_HEADS = 8


def rope_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    layer_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
    layer_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of the q and k heads ``qk`` [T, H + KV, D] (per-head RMSNorm with ``norm_weights`` = (q, k)
    first), and k/v ([T, KV, D]) stored into ``layer_cache`` [2, blocks, block_size, KV, D] at
    ``slot_mapping`` -> (q [T, H, D], k [T, KV, D]), both contiguous. cos/sin: [T, D], model dtype.
    ``layer_scales`` [2, blocks, block_size, KV]: the cache is FP8 (``runner/kv_cache.py``), each k and v
    row stored quantized with its scale (``kv_cache.store``'s bits)."""
    tokens, heads, head_dim = qk.shape
    if norm_weights is not None and head_dim <= 32:  # layers.fusable_head_norm says why
        raise ValueError(
            f"rope_store_kv: per-head norms need head_dim > 32 to match triton_norm, got {head_dim}"
        )
    num_kv = heads - num_heads
    q_out = torch.empty(tokens, num_heads, head_dim, dtype=qk.dtype, device=qk.device)
    k_out = torch.empty(tokens, num_kv, head_dim, dtype=qk.dtype, device=qk.device)
    if tokens == 0:
        return q_out, k_out
    if qk.stride(-1) != 1:
        qk = qk.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    has_cache, fp8 = layer_cache is not None, layer_scales is not None
    wanted = torch.float8_e4m3fn if fp8 else qk.dtype
    if has_cache and (not layer_cache.is_contiguous() or layer_cache.dtype != wanted):
        raise ValueError(f"rope_store_kv: the KV cache must be contiguous {wanted}, got {layer_cache.dtype}")
    if fp8 and not layer_scales.is_contiguous():
        raise ValueError("rope_store_kv: the FP8 cache's scales must be contiguous")
    if norm_weights is None:
        grid = (tokens, triton.cdiv(heads + (num_kv if has_cache else 0), ROPE_HEADS))
        _rope_store_kv_heads_kernel[grid](
            qk, v, cos, sin, q_out, k_out, layer_cache if has_cache else qk,
            layer_scales if fp8 else qk,  # unused without an FP8 cache
            slot_mapping if has_cache else qk, qk.stride(0), qk.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), layer_cache[0].numel() if has_cache else 0, num_heads, num_kv, head_dim,
            HAS_CACHE=has_cache, FP8=fp8, HEADS=ROPE_HEADS, BLOCK=triton.next_power_of_2(head_dim),
            num_warps=4,
            enable_reflect_ftz=False,  # mul_rn / add_rn keep denormals, as torch's kernels do
        )  # fmt: skip
        return q_out, k_out
    q_weight, k_weight = norm_weights
    grid = (tokens, heads + (num_kv if has_cache else 0))
    _rope_store_kv_kernel[grid](
        qk,
        v,
        cos,
        sin,
        q_weight,
        k_weight,
        q_out,
        k_out,
        layer_cache if has_cache else qk,
        layer_scales if fp8 else qk,  # unused without an FP8 cache
        slot_mapping if has_cache else qk,
        qk.stride(0),
        qk.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        layer_cache[0].numel() if has_cache else 0,
        num_heads,
        num_kv,
        head_dim,
        eps,
        HAS_CACHE=has_cache,
        FP8=fp8,
        BLOCK=triton.next_power_of_2(head_dim),
        num_warps=4,  # triton_norm's layout for a head (its sum of squares must reduce in the same order)
        # The flag stays at triton_norm's default so that its rsqrt is the same instruction
        # (rsqrt.approx.ftz).
        enable_reflect_ftz=True,
    )
    return q_out, k_out
