"""Dynamic FP8 activation quantization in one Triton launch (CUDA): ``fp8.quantize_rows`` for the
``torch._scaled_mm`` path of ``linear.py``.

In torch, quantizing a token's activations per row is about eight kernels (abs, amax, the scale, the
division, the clamp, the cast...) before every FP8 GEMM; at decode, where a step is hundreds of small
kernels, that would eat much of what reading half the weight bytes saves. Here one program per (row,
group of columns) reads its values twice (the maximum, then the quantization) and writes the e4m3 values
and the scale. Same arithmetic as ``quantize_rows`` on CUDA, operation for operation, so the results are
bit-equal (tests/rollout/test_fp8_gpu.py):

- ``scale = amax * fl32(1/448)`` (1 for an all-zero group): torch on CUDA computes ``amax / 448`` as a
  product with the float32 reciprocal (its CPU-scalar fast path), not as a division, so ``fp8.py``
  writes that product on every device and so does this kernel (the reciprocal an IEEE ``div_rn``);
- ``x * inverse`` with ``inverse = 1 / scale`` (``e4m3_inverse``: an IEEE ``div_rn`` once a row, capped
  at float32's largest finite value) as ``e4m3.quantize_rows`` computes it with torch's ``reciprocal``;
- clamped to +-448, then cast to e4m3 rounding to nearest even (``fp_downcast_rounding="rtne"``, as
  torch's cast rounds; on sm90 Triton converts float32 to e4m3 directly, no float16 step).

(Triton's libdevice flushes a subnormal scale to zero in ``div_rn``, so a row whose largest value is below
~5e-36 takes the capped reciprocal here where torch may not: its values, all below 5e-36, may then
quantize differently.)

With ``group`` the scales come out outer-dimension-major ([M, K/group] with strides (1, M)), the layout
torch's block-wise GEMM reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.rollout.kernels.triton_e4m3 import e4m3_scale, to_e4m3


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_x,
    stride_q,
    stride_s_row,
    stride_s_group,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    group = tl.program_id(1)
    start = group * GROUP
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row.to(tl.int64) * stride_x + start
    q_row = q_ptr + row.to(tl.int64) * stride_q + start
    width = tl.where(row < M, K, 0)  # rows past M: padding, nothing loaded (zeros, scale 1)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, GROUP, BLOCK):
        mask = (k0 + cols < GROUP) & (start + k0 + cols < width)
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = e4m3_scale(tl.max(amax, axis=0))
    tl.store(s_ptr + row.to(tl.int64) * stride_s_row + group * stride_s_group, scale)
    for k0 in range(0, GROUP, BLOCK):
        inside = (k0 + cols < GROUP) & (start + k0 + cols < K)  # every row is stored, padding included
        x = tl.load(x_row + k0 + cols, mask=inside & (start + k0 + cols < width), other=0.0).to(tl.float32)
        tl.store(q_row + k0 + cols, to_e4m3(x, scale), mask=inside)


def quantize_rows_triton(
    x: torch.Tensor, group: int | None = None, padded: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_rows`` of ``x`` [M, K] (CUDA): (e4m3 [M, K], float32 scales [M, 1] or, with
    ``group``, [M, K/group] outer-dimension-major); ``padded`` (>= M): that many rows, the extra ones
    zero with scale 1, written by the same launch (no copy)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    real, k = x.shape
    m = max(real, padded or 0)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    width = k if group is None else group
    groups = 1 if group is None else k // group
    if group is None:
        scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:  # [M, groups] with strides (1, M)
        scales = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    # A row (or group) of up to 4096 columns in one block: each pass is one load, not a loop (7B's o_proj
    # input, 3584 columns, took 4.6 µs at 256 rows with 1024-column blocks on the H200)
    block = min(4096, triton.next_power_of_2(width))
    _quantize_rows_kernel[(m, groups)](
        x, q, scales, real, k, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
        GROUP=width, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return q, scales
