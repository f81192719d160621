"""The e4m3 arithmetic of FP8 rollouts' dynamic activation quantization, as ``@triton.jit`` helpers: shared by
the quantization launch (``quant/triton_fp8.py``) and the norm and SiLU·up kernels that quantize what they
write (``models/triton_norm.py``, ``models/triton_fused.py``), so every path gives the same bits. Its own
module, outside ``tidal.rollout.quant``, whose package imports the models (an import cycle otherwise).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_scale(amax):
    """A row's (or group's) dequantization scale from its float32 absolute maximum: ``amax * fl32(1/448)``,
    1 for an all-zero row. Shared by ``quant/triton_fp8.py``'s launch and the kernels that quantize as they
    write (``triton_norm``'s RMSNorm, ``triton_fused.silu_and_mul_fp8``), so both give the same bits."""
    one = tl.zeros_like(amax) + 1.0  # tensors on both sides of the IEEE division
    inverse = tl.math.div_rn(one, one * 448.0)  # fl32(1/448), as torch's CPU-scalar division uses
    return tl.where(amax > 0, amax * inverse, 1.0)


@triton.jit
def e4m3_inverse(scale):
    """``e4m3.inverse_scales``: the IEEE reciprocal of a dequantization scale, at most float32's largest
    finite value (a scale so small its reciprocal overflows would otherwise turn a zero into a NaN)."""
    one = scale * 0.0 + 1.0
    return tl.minimum(tl.math.div_rn(one, scale), 3.4028234663852886e38)


@triton.jit
def to_e4m3(x, scale):
    """float32 ``x`` times the reciprocal of its ``scale`` (``e4m3_inverse``: one IEEE division a row, not one
    an element), clamped to +-448, cast to e4m3 rounding to nearest even."""
    q = tl.minimum(tl.maximum(x * e4m3_inverse(scale), -448.0), 448.0)
    return q.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def store_e4m3_row(dst_ptr, scale_ptr, x, mask):
    """Quantize one row ``x`` (a key or value head of an FP8 KV cache, ``runner/kv_cache.py``) with its own
    scale and store both: ``kv_cache.quantize_heads``' arithmetic (amax of the row, ``e4m3_scale``,
    ``to_e4m3``), so a Triton store and the torch one give the same bits."""
    x32 = x.to(tl.float32)
    scale = e4m3_scale(tl.max(tl.where(mask, tl.abs(x32), 0.0), 0))
    tl.store(dst_ptr, to_e4m3(x32, scale), mask=mask)
    tl.store(scale_ptr, scale)
