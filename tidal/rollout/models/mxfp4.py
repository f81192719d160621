"""MXFP4 weights (OCP Microscaling formats v1.0): dequantisation of packed blocks to a float dtype.

An MXFP4 tensor stores blocks of 32 values that share one scale:

- each value is FP4 E2M1 (1 sign bit, 2 exponent bits with bias 1, 1 mantissa bit): an exponent field of
  0 is subnormal, ``(-1)^s * 0.5 * m``; otherwise ``(-1)^s * 2^(e - 1) * (1 + m / 2)``, which gives the
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6;
- two values are packed per byte, the block's even element in the low nibble, the odd one in the high;
- each block's scale is E8M0 (an unsigned biased exponent): ``2^(s - 127)``, with 255 meaning NaN.

gpt-oss checkpoints quantise their expert projections this way (``quantization_config.quant_method``
"mxfp4"): ``<name>_blocks`` [..., G, 16] uint8 (G blocks of 16 bytes per row) and ``<name>_scales``
[..., G] uint8 give the row-major tensor [..., G * 32]. The engine dequantises on load (``gpt_oss.py``).
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per shared scale
_SCALE_BIAS = 127
_SCALE_NAN = 255


def e2m1_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 values of FP4 E2M1, indexed by their 4-bit code."""
    codes = torch.arange(16)
    sign, exponent, mantissa = codes >> 3, (codes >> 1) & 3, codes & 1
    normal = torch.pow(2.0, exponent.float() - 1) * (1 + mantissa.float() / 2)
    magnitude = torch.where(exponent == 0, mantissa.float() / 2, normal)
    return torch.where(sign == 1, -magnitude, magnitude).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32):
    """``blocks`` [..., G, 16] uint8 and ``scales`` [..., G] uint8 -> [..., G * 32] of ``dtype``.

    Computed in float32 one leading slice at a time (one expert of a stacked tensor), so the float copy
    of a large checkpoint tensor is made piece by piece; every value is exact in float32 and bfloat16
    (a 2-bit mantissa times a power of two within their exponent range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: expected "
            f"blocks [..., G, {BLOCK // 2}] and scales [..., G]"
        )
    lut = e2m1_values(torch.float32).to(blocks.device)
    if blocks.dim() <= 3:  # one matrix (or less): dequantise it at once
        return _dequantize(blocks, scales, lut).to(dtype)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK, dtype=dtype, device=blocks.device)
    for i in range(blocks.shape[0]):
        out[i] = _dequantize(blocks[i], scales[i], lut).to(dtype)
    return out


def _dequantize(blocks: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16], scales [..., G] -> [..., G * 32] float32."""
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    exponent = scales.to(torch.int32) - _SCALE_BIAS
    values = torch.ldexp(values, exponent[..., None])
    values = values.masked_fill((scales == _SCALE_NAN)[..., None], float("nan"))
    return values.flatten(-2)
