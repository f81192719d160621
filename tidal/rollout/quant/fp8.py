"""FP8 (e4m3) quantization of weights and activations: pure functions, no modules.

A weight is stored as ``q`` (``torch.float8_e4m3fn``) and float32 *dequantization* scales ``s`` so that
``w ≈ q * s``. Two scale granularities (``--rollout_quantization``):

- ``fp8``: one scale per output channel (row of ``[out, in]``; per expert and row of a stacked
  ``[E, out, in]``), ``s = amax(|row|) / 448``;
- ``fp8_block``: one scale per 128 x 128 tile (DeepSeek-V3's and vLLM's block layout), the last tiles of
  a dimension not divisible by 128 being smaller.

Rounding: e4m3 has 3 mantissa bits, so a value ``w / s`` in the normal range (``>= 2**-6``) is rounded
with a relative error of at most ``2**-4`` (half a unit in the last place); below it (subnormals, spacing
``2**-9``) the absolute error is at most ``2**-10 * s``. ``w / s`` is clamped to 448 (the largest e4m3
value; ``s`` is ``amax`` times a rounded 1/448, so the quotient can exceed 448 by an ulp): the row or
tile's largest element maps to 448 itself. An all-zero row or tile gets scale 1 (its
values stay zero). Activations are quantized dynamically per token (``quantize_rows``; per token and
group of 128 columns for the block recipe), as the GEMM of ``linear.py`` reads them.
"""

from __future__ import annotations

import torch

# The e4m3 arithmetic this shares with the FP8 KV cache (``runner/kv_cache.py``) lives outside the package
# (which imports the models); ``quantize_rows`` and ``E4M3_MAX`` are read from here by the GEMM and tests.
from tidal.rollout.e4m3 import E4M3_MAX, quantize_rows, scales_from_amax, to_e4m3  # noqa: F401

BLOCK = 128  # the side of a ``fp8_block`` tile

# --rollout_quantization values -> scale granularity ("none": the engine keeps the model dtype)
GRANULARITIES = {"fp8": "channel", "fp8_block": "block"}
QUANTIZATIONS = ("none", *GRANULARITIES)


def quantization_problem(value: str) -> str | None:
    """Why ``value`` is not a ``--rollout_quantization`` setting (None: it is)."""
    if value in QUANTIZATIONS:
        return None
    return f"--rollout_quantization must be one of {', '.join(QUANTIZATIONS)}, not {value!r}"


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """Per-row scales of ``w`` [..., out, in] -> [..., out, 1] float32."""
    return scales_from_amax(w.abs().amax(dim=-1, keepdim=True))


def _tiles(w: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """``w`` [..., R, C] zero-padded to multiples of ``block`` and viewed as [..., R/b, b, C/b, b]."""
    rows, cols = w.shape[-2:]
    pad_r, pad_c = -rows % block, -cols % block
    if pad_r or pad_c:
        w = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    tiles = w.reshape(*w.shape[:-2], (rows + pad_r) // block, block, (cols + pad_c) // block, block)
    return tiles, (rows, cols)


def block_scales(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per-tile scales of ``w`` [..., R, C] -> [..., ceil(R/b), ceil(C/b)] float32."""
    tiles, _ = _tiles(w, block)
    return scales_from_amax(tiles.abs().amax(dim=(-3, -1)))


def expand_block_scales(scales: torch.Tensor, shape: tuple[int, int], block: int = BLOCK) -> torch.Tensor:
    """Tile scales [..., ceil(R/b), ceil(C/b)] repeated to every element of [..., R, C]."""
    rows, cols = shape
    full = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :rows, :cols]


def quantize(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(``q`` e4m3 of ``w``'s shape, float32 scales) of a weight [..., out, in]; ``granularity``:
    ``"channel"`` (scales [..., out, 1]) or ``"block"`` (scales [..., ceil(out/128), ceil(in/128)])."""
    w32 = w.float()
    if granularity == "channel":
        scales = channel_scales(w32)
        return to_e4m3(w32 / scales), scales
    if granularity == "block":
        scales = block_scales(w32)
        return to_e4m3(w32 / expand_block_scales(scales, tuple(w.shape[-2:]))), scales
    raise ValueError(f"unknown FP8 scale granularity {granularity!r} (channel or block)")


def dequantize(q: torch.Tensor, scales: torch.Tensor, granularity: str, dtype: torch.dtype) -> torch.Tensor:
    """``q * scales`` (in float32, then rounded once to ``dtype``): the weight the FP8 GEMM multiplies by."""
    if granularity == "block":
        scales = expand_block_scales(scales, tuple(q.shape[-2:]))
    return (q.float() * scales).to(dtype)


def quantize_dequantize(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """``w`` rounded through FP8 and back to its dtype: what the emulated (CPU) path computes with."""
    q, scales = quantize(w, granularity)
    return dequantize(q, scales, granularity, w.dtype)
