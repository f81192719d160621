"""Qwen3.5's Gated DeltaNet element-wise work as single Triton launches (CUDA only; ``qwen3_5.py`` falls
back to torch), each with the arithmetic and roundings of the torch ops it replaces:

- ``gated_rms_norm`` (``GatedRMSNorm.forward``, ~10 kernels): an RMSNorm of each value head normalised in
  float32 and rounded to the model dtype, times the weight (rounded like torch's product of the two:
  to the model dtype unless either is float32), times ``silu(z)`` in float32, rounded once. The mean is
  torch's CUDA mean (sum times ``fl(1 / n)``); SiLU is ``triton_fused``'s (libdevice ``expf``, IEEE
  division), as torch's CUDA kernel computes it.
- ``decay_and_beta`` (``GatedDeltaNet.forward``, ~6 kernels): ``beta = sigmoid(b)`` in ``b``'s dtype and
  the per-head decay ``g = -exp(A_log) * softplus(a + dt_bias)`` in float32 (torch's threshold 20).

The sum of squares is reduced in another order than torch's reduce kernel, so the norm is not bit-equal
in general (float32 results may differ in the last bits; a 16-bit rounding may flip by one ulp). Under
Triton's interpreter (CPU tests) numpy's float32 functions stand in for libdevice's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from tidal.rollout.models.triton_fused import _INTERPRETED, SILU_CONTRACT, _mul_rn, _silu
from tidal.rollout.models.triton_norm import inverse_count, row_layout


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    n_cols,
    x_inner,
    x_outer_stride,
    x_inner_stride,
    z_inner,
    z_outer_stride,
    z_inner_stride,
    eps,
    inv_n,
    ROUND_PRODUCT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_src = (row // x_inner) * x_outer_stride + (row % x_inner) * x_inner_stride
    z_src = (row // z_inner) * z_outer_stride + (row % z_inner) * z_inner_stride
    x = tl.load(x_ptr + x_src + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(_mul_rn(tl.sum(x32 * x32, 0), inv_n) + eps)
    normed = (x32 * inv).to(x.dtype).to(tl.float32)
    scaled = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * normed
    if ROUND_PRODUCT:  # weight * normed in the model dtype (neither is float32)
        scaled = scaled.to(x.dtype).to(tl.float32)
    z = tl.load(z_ptr + z_src + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (scaled * _silu(z)).to(x.dtype), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``GatedRMSNorm.forward``: RMSNorm of ``x`` over its last dim (plain ``weight``) times ``silu(z)``,
    in ``x``'s dtype, contiguous. ``x`` and ``z`` (same shape, 2-D or 3-D) are read in place when their last
    dim is unit-strided (``z`` a head view of the packed projection)."""
    if x.shape != z.shape:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and z {tuple(z.shape)} differ")
    n_cols = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // n_cols if n_cols else 0
    if rows == 0:
        return out
    x, x_inner, x_outer, x_stride = row_layout(x)
    z, z_inner, z_outer, z_stride = row_layout(z)
    _gated_rms_norm_kernel[(rows,)](
        x,
        z,
        weight,
        out,
        n_cols,
        x_inner,
        x_outer,
        x_stride,
        z_inner,
        z_outer,
        z_stride,
        eps,
        inverse_count(n_cols),
        ROUND_PRODUCT=torch.promote_types(weight.dtype, x.dtype) == x.dtype != torch.float32,
        BLOCK=triton.next_power_of_2(n_cols),
        num_warps=4 if n_cols <= 2048 else 8,
        enable_fp_fusion=SILU_CONTRACT,
        enable_reflect_ftz=False,  # libdevice without flush-to-zero, as torch's kernels are built
    )
    return out


@triton.jit
def _exp(x):
    if _INTERPRETED:
        out = tl.exp(x)
    else:
        out = libdevice.exp(x)
    return out


@triton.jit
def _softplus(x):
    """torch's CUDA softplus (beta 1, threshold 20): x above 20, else log1p(expf(x))."""
    if _INTERPRETED:
        soft = tl.log(1.0 + tl.exp(x))
    else:
        soft = libdevice.log1p(libdevice.exp(x))
    return tl.where(x > 20.0, x, soft)


@triton.jit
def _decay_and_beta_kernel(
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    tokens,
    heads,
    stride_a,
    stride_b,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    h = tl.arange(0, BLOCK_H)[None, :]
    mask = (t < tokens) & (h < heads)
    b = tl.load(b_ptr + t * stride_b + h, mask=mask, other=0.0)
    if _INTERPRETED:
        beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    else:  # torch's CUDA sigmoid: 1 / (1 + expf(-x)), IEEE division
        beta = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-b.to(tl.float32)))
    tl.store(beta_ptr + t * heads + h, beta.to(b.dtype), mask=mask)
    a = tl.load(a_ptr + t * stride_a + h, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    decay = _exp(tl.load(a_log_ptr + h, mask=h < heads, other=0.0).to(tl.float32)) * -1.0
    tl.store(g_ptr + t * heads + h, decay * _softplus(a + dt_bias), mask=mask)


def decay_and_beta(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``g``, ``beta``) of ``GatedDeltaNet.forward`` for ``a``/``b`` [tokens, heads] (unit last stride, e.g.
    slices of the packed projection): ``g = -exp(A_log) * softplus(a + dt_bias)`` float32 and
    ``beta = sigmoid(b)`` in ``b``'s dtype, both contiguous."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    tokens, heads = b.shape
    g = torch.empty(tokens, heads, dtype=torch.float32, device=b.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens == 0:
        return g, beta
    block_h = triton.next_power_of_2(heads)
    block_t = max(1, min(64, 1024 // block_h))
    _decay_and_beta_kernel[(triton.cdiv(tokens, block_t),)](
        a,
        b,
        a_log,
        dt_bias,
        g,
        beta,
        tokens,
        heads,
        a.stride(0),
        b.stride(0),
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=SILU_CONTRACT,  # 1 + expf(-x) as in SiLU
        enable_reflect_ftz=False,
    )
    return g, beta
