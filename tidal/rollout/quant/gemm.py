"""The FP8 GEMM of a quantized linear layer's forward (``linear.Fp8Forward``, and the probe that checks it
once per weight shape): the activations quantized per token (and per 128 columns for block scales), then
``triton_fp8_gemm`` at decode token counts and for every block-scaled product, else ``torch._scaled_mm``.
No Triton import at module level: CI and CPU machines import this without it.
"""

from __future__ import annotations

import torch

from tidal.accel import sm_count, triton_usable
from tidal.rollout.quant.fp8 import BLOCK, quantize_rows
from tidal.rollout.quant.fp8_gemm_config import gemm_config


def padded_columns(blocks: int) -> int:
    """Columns of a block-scale buffer over ``blocks`` K-blocks: rounded up to a multiple of 4, the leading
    dimension torch's 128x128 block-wise GEMM reads its column-major ``scale_b`` with."""
    return -(-blocks // 4) * 4


def padded_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [N/128, K/128] with their columns padded (ones) to ``padded_columns``; already padded
    scales come back as they are (the modules' buffers are allocated padded, so no copy runs per step)."""
    pad = -scales.shape[-1] % 4
    return scales if pad == 0 else torch.nn.functional.pad(scales, (0, pad), value=1.0)


def fp8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    granularity: str,
    bias: torch.Tensor | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x`` [..., K] (bf16) times the FP8 weight ``q`` [N, K] (dequantization ``scales``: [N, 1], or
    [N/128, K/128] optionally padded as ``padded_block_scales``) -> [..., N] in ``x.dtype``: the activations
    quantized per token (and 128 columns for blocks), then a GEMM applying both scales (and ``bias``,
    per-channel only: ``fuses_bias``) to the float32 accumulator: ``triton_fp8_gemm`` at decode token
    counts and for every block-scaled one (``fp8_gemm_config.gemm_config``), else ``torch._scaled_mm``.
    ``q.t()`` is a view: the buffer, row-major [N, K], is the column-major [K, N] operand torch's GEMM
    reads, so nothing is copied. ``x_fp8``: ``x``'s rows already quantized per token (e4m3 [M, K], scales
    [M, 1]; per-channel only), by the kernel that wrote ``x`` (``RMSNorm.feeds_fp8``)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], q.shape[0])
    block = granularity == "block"
    if config := _triton_gemm_config(rows, q, block):
        from tidal.rollout.quant.triton_fp8_gemm import fp8_gemm

        xq, xs = (
            x_fp8
            if x_fp8 is not None and not block
            else _quantize_activations(rows, BLOCK if block else None)
        )
        out = fp8_gemm(xq, xs, q, scales, config, bias, x.dtype, block)  # reads scales through strides
    elif not block:
        xq, xs = x_fp8 if x_fp8 is not None else _quantize_activations(rows, None)
        # Fast accumulation (the tensor core's own, no float32 promotion every few K steps), as vLLM's
        # Hopper FP8 GEMMs and tidal's Triton launches accumulate: 11% off the 7B gate/up GEMM at 256 rows
        # (65.1 -> 57.7 us on the H200), relative error 0.0021 vs 0.0017, below bf16's rounding.
        out = torch._scaled_mm(
            xq,
            q.t(),
            scale_a=xs,
            scale_b=scales.view(1, -1),
            bias=bias,
            out_dtype=x.dtype,
            use_fast_accum=True,
        )
    else:  # without Triton: cuBLAS's block-wise GEMM
        if bias is not None:
            raise ValueError("fp8_linear: a fused bias needs per-channel scales")
        # Token count padded to a multiple of 128 (zero rows, scale 1; their outputs dropped): cuBLAS's
        # block-wise GEMM on the H200 refused 1 and 3000 tokens and took 32 and 256.
        tokens = rows.shape[0]
        xq, xs = _quantize_activations(rows, BLOCK, -(-tokens // BLOCK) * BLOCK)
        scale_b = padded_block_scales(scales)[:, : x.shape[-1] // BLOCK].t()  # [K/128, N/128], stride [1, L4]
        out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale_b, out_dtype=x.dtype)[:tokens]
    return out.view(*x.shape[:-1], q.shape[0])


def _triton_gemm_config(rows: torch.Tensor, q: torch.Tensor, block: bool):
    """``triton_fp8_gemm``'s launch for these rows (CUDA), or None where ``torch._scaled_mm`` runs them."""
    if not triton_usable(rows):
        return None
    return gemm_config(rows.shape[0], *q.shape, sm_count(rows.device), block)


def _quantize_activations(
    rows: torch.Tensor, group: int | None, padded: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows``: one Triton launch on CUDA (``triton_fp8.py``, bit-equal), else the torch ops.
    With ``group`` the scales are outer-dimension-major ([M, K/group], strides (1, M)), as torch's
    block-wise GEMM reads them; ``padded``: that many rows, the extra ones zero (scale 1)."""
    if triton_usable(rows):
        from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

        return quantize_rows_triton(rows, group, padded)
    if padded is not None and padded > rows.shape[0]:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, padded - rows.shape[0]))
    q, scales = quantize_rows(rows, group)
    return q, scales if group is None else scales.t().contiguous().t()
