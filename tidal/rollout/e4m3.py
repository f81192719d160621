"""The e4m3 (``torch.float8_e4m3fn``) arithmetic in torch, shared by FP8 rollouts' weights and activations
(``tidal.rollout.quant.fp8``) and the FP8 KV cache (``runner/kv_cache.py``); ``kernels/triton_e4m3.py`` is
the same arithmetic in Triton, bit for bit. Its own module because ``tidal.rollout.quant`` imports the
models, which import the KV cache's readers (an import cycle otherwise).

A value ``x`` is stored as ``q = x / s`` in e4m3 with a float32 *dequantization* scale ``s`` (``x ≈ q * s``),
``s = amax / 448`` over the values sharing it (a row, a tile), so their largest maps to 448 itself.
Activations and KV rows (``quantize_rows``) compute ``x / s`` as ``x * (1 / s)``, the reciprocal rounded
once a row, as vLLM's quantization kernels do: an IEEE division an element took up to half the time of the
Triton kernels that quantize as they write (H200, 7B shapes at 256 tokens: the FP8 norm 5.4 -> 3.3 µs, the
activation quantization 4.3 -> 2.1, SiLU·up 14.5 -> 11.8; docs/benchmarks.md, session 23). The two can differ
only where ``x / s`` lies within an ulp of a rounding boundary of e4m3 (none of 917k random values did).
Weights, quantized once a sync by torch alone, keep the division.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Scales are ``amax * (1/448)`` with the reciprocal rounded to float32 once, not ``amax / 448``: on CUDA
# torch turns a division by a Python number into that very product (a CPU-scalar fast path), on the CPU
# it divides; one formula keeps both devices and the Triton kernels (``triton_e4m3.py``) bit-equal.
INV_E4M3_MAX = 1.0 / E4M3_MAX


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Dequantization scales ``amax * fl32(1/448)`` (float32; ``INV_E4M3_MAX``), 1 where ``amax`` is 0 (the
    values are all zero)."""
    amax = amax.float()
    return torch.where(amax > 0, amax * INV_E4M3_MAX, torch.ones_like(amax))


def inverse_scales(scales: torch.Tensor) -> torch.Tensor:
    """``1 / scales`` (IEEE on both devices), at most float32's largest finite value: a row whose largest
    value is below ~1.3e-36 has a scale whose reciprocal would overflow, and ``0 * inf`` is a NaN."""
    return scales.reciprocal().clamp(max=torch.finfo(torch.float32).max)


def to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` (values over their scale) cast to e4m3, rounding to nearest even."""
    # torch's cast does not saturate (448 < |x| becomes NaN): clamp first (a quotient can exceed 448 by
    # an ulp, ``s`` being amax times a rounded 1/448).
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row quantization of ``x`` [M, K]: (e4m3 [M, K], float32 scales [M, 1]); with ``group``
    (the block recipe's 128), one scale per row and group of ``group`` columns ([M, ceil(K/group)]; K must
    be a multiple of ``group``). FP8 rollouts quantize each token's activations so; the FP8 KV cache each
    key and value row of a head."""
    if group is None:
        scales = scales_from_amax(x.abs().amax(dim=-1, keepdim=True))
        return to_e4m3(x.float() * inverse_scales(scales)), scales
    m, k = x.shape
    grouped = x.reshape(m, k // group, group)
    scales = scales_from_amax(grouped.abs().amax(dim=-1))
    return to_e4m3(grouped.float() * inverse_scales(scales)[..., None]).reshape(m, k), scales
