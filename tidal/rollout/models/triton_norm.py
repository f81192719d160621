"""Fused residual-add + RMSNorm as one Triton kernel (CUDA only; ``layers.RMSNorm`` falls back to torch).

In plain torch an RMSNorm is ~7 elementwise/reduction kernels, plus one for the residual add: at decode
batch sizes each is a few microseconds of mostly launch and tail, and a 24-layer model runs 48 of them
per step. One kernel per norm does the same arithmetic. The sum is rounded to the model dtype like
torch's add, then one of two scalings, as ``RMSNorm._norm`` and ``GemmaRMSNorm._norm`` compute them:

- default (Llama): normalised in float32, rounded to the model dtype, then scaled by the weight;
- ``scale_in_float32`` (Gemma, Qwen3.5: ``1 + weight``; GPT-OSS: ``weight``, ``offset`` 0): normalised
  and scaled in float32, rounded once. The mean is torch's CUDA mean, the sum times ``fl(1 / n)``
  (``MeanOps``), rounded before ``+ eps`` (``mul_rn``: no fused multiply-add torch's two kernels lack).

``add_rms_norm_fp8`` (FP8 rollouts) also writes the stored rows' e4m3 values and per-token scales for the
FP8 linear layer that reads them, with ``quant/triton_fp8.py``'s arithmetic (the ``kernels/triton_e4m3``
helpers; bit-equal to its launch).

Rows are the last dim; 3-D inputs ([tokens, heads, dim], e.g. q/k head norms on a packed projection)
are read in place through two strides, so a view of a projection is not copied first. Neither variant
matches torch bit for bit in general: the sum of squares is reduced in another order than torch's reduce
kernel, so float32 results may differ in the last bits and a bf16 rounding may flip by one ulp.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from tidal.rollout.kernels.triton_e4m3 import e4m3_scale, to_e4m3
from tidal.rollout.models.triton_fused import _mul_rn


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    q_ptr,
    s_ptr,
    n_cols,
    n_inner,
    stride_outer,
    stride_inner,
    eps,
    inv_n,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    SCALE_F32: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    src = (row // n_inner) * stride_outer + (row % n_inner) * stride_inner  # row-major when n_inner = 1
    x = tl.load(x_ptr + src + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if SCALE_F32:
        inv = tl.rsqrt(_mul_rn(tl.sum(x32 * x32, 0), inv_n) + eps)
        out = (x32 * inv) * (w + offset)  # Gemma: x32 * rsqrt(..) * (1 + w), one rounding at the store
    else:  # unchanged (triton_fused.rope_store_kv reproduces this arithmetic bit for bit)
        inv = tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
        out = w * (x32 * inv).to(x.dtype).to(tl.float32)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)
    if QUANTIZE:  # the stored values quantized per row, as triton_fp8's launch would read them back
        stored = out.to(tl.float32)
        scale = e4m3_scale(tl.max(tl.where(mask, tl.abs(stored), 0.0), 0))
        tl.store(q_ptr + row * n_cols + cols, to_e4m3(stored, scale), mask=mask)
        tl.store(s_ptr + row, scale)


def row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` as rows of its last dim read through two strides: (tensor, rows per outer index, outer stride,
    inner stride). A 2-D or 3-D tensor with a unit last stride is used as it is (a head view of a packed
    projection); anything else is made contiguous first."""
    if x.dim() == 3 and x.stride(-1) == 1:
        return x, x.shape[1], x.stride(0), x.stride(1)
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.contiguous()
    return x, 1, x.stride(0) if x.dim() == 2 else x.shape[-1], 0


@functools.cache
def inverse_count(n: int) -> float:
    """torch's CUDA mean factor: ``1 / n`` rounded to float32 (a Python float holding that value)."""
    return float(np.float32(1.0) / np.float32(n))


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual`` (or of ``x``) over the last dim -> (normed, x + residual). ``weight_offset``
    None: the default rounding (normed in ``weight``'s dtype); a float: ``scale_in_float32``, scaled by
    ``weight + weight_offset`` in float32 and rounded once to ``x``'s dtype (Gemma's offset is 1)."""
    out, total, _ = _launch(x, weight, eps, residual, weight_offset, quantize=False)
    return out, total


def add_rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``add_rms_norm`` that also quantizes the normed rows for an FP8 linear layer, in the same launch:
    (normed, x + residual, (e4m3 [rows, dim], float32 scales [rows, 1])), bit-equal to
    ``triton_fp8.quantize_rows_triton(normed)`` (it saves that launch and its two reads per layer)."""
    return _launch(x, weight, eps, residual, weight_offset, quantize=True)


def _launch(x, weight, eps, residual, weight_offset, quantize: bool):
    n_cols = x.shape[-1]
    if residual is None:
        flat, n_inner, stride_outer, stride_inner = row_layout(x)
        total = x
    else:  # the residual stream: [tokens, hidden], contiguous
        flat, residual = x.contiguous(), residual.contiguous()
        n_inner, stride_outer, stride_inner = 1, n_cols, 0
        total = torch.empty_like(flat)
    scale_f32 = weight_offset is not None
    out = torch.empty(x.shape, dtype=x.dtype if scale_f32 else weight.dtype, device=x.device)
    rows = out.numel() // n_cols if n_cols else 0
    fp8 = None
    if quantize:
        fp8 = (
            torch.empty((rows, n_cols), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((rows, 1), dtype=torch.float32, device=x.device),
        )
    if rows == 0:
        return out, total, fp8
    _add_rms_norm_kernel[(rows,)](
        flat,
        residual if residual is not None else flat,
        weight,
        out,
        total,
        *(fp8 if quantize else (out, out)),
        n_cols,
        n_inner,
        stride_outer,
        stride_inner,
        eps,
        inverse_count(n_cols),
        weight_offset or 0.0,
        HAS_RESIDUAL=residual is not None,
        SCALE_F32=scale_f32,
        QUANTIZE=quantize,
        BLOCK=triton.next_power_of_2(n_cols),
        num_warps=4 if n_cols <= 2048 else 8,
    )
    return out, total, fp8
