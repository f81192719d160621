"""Which FP8 GEMM runs a linear layer's product, and with which launch (no Triton needed, so the rules are
tested where Triton is not installed): ``gemm_config`` returns a ``Fp8GemmConfig`` for
``triton_fp8_gemm.fp8_gemm`` or None for ``torch._scaled_mm``.

A launch comes from ``fp8_gemm_tuned.TUNED``, measured on a GPU per weight shape and token bucket by
``bench/fp8_gemm.py --search --write`` (``None`` there: ``torch._scaled_mm`` was faster), else from
``default_config``'s rule, up to ``MAX_ROWS`` tokens. Above that (prefill) per-channel layers keep
``torch._scaled_mm``. Block-scaled layers always take the Triton kernel: cuBLAS's block-wise GEMM refused
token counts on the H200.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tidal.rollout.quant import fp8_gemm_tuned
from tidal.rollout.quant.fp8 import BLOCK  # fp8_block's scale block, the K step of every launch here


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MAX_ROWS = 512  # token counts up to this take the Triton kernel by default (decode); larger ones torch's


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch: output tile ``block_m x block_n``, K step ``block_k``, K cut into ``split_k`` ranges,
    tiles loaded by pointers or by TMA."""

    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    tma: int = 0  # 1: tiles loaded by TMA (Hopper's copy engine) where the operands allow it

    def fields(self) -> dict[str, int]:
        return asdict(self)


def row_bucket(m: int) -> int:
    """The token bucket a tuned tile is recorded under: the next power of two, at least 16."""
    return max(16, 1 << (m - 1).bit_length())


def default_config(m: int, n: int, k: int, sms: int) -> Fp8GemmConfig:
    """A tile for ``m`` tokens when none was measured: rows rounded up to a power of two (16..128), 64 or
    128 columns, and K cut so that the tiles and ranges fill the SMs about once (each range at least four K
    steps long)."""
    block_m = min(128, row_bucket(m))
    block_n = 64 if n <= 1024 or block_m <= 32 else 128
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    steps = _cdiv(k, BLOCK)
    split_k = max(1, min(sms // tiles, steps // 4, 8))
    return Fp8GemmConfig(block_m, block_n, BLOCK, split_k, 8 if block_m * block_n >= 128 * 128 else 4, 4)


def gemm_config(m: int, n: int, k: int, sms: int, block_scaled: bool) -> Fp8GemmConfig | None:
    """The Triton launch for ``m`` tokens times a weight [n, k] on a GPU of ``sms`` SMs, or None where
    ``torch._scaled_mm`` runs it (measured faster, or above ``MAX_ROWS`` tokens). Block-scaled products
    always take the Triton kernel; a tuned tile only applies to per-channel scales."""
    if not block_scaled:
        tuned = fp8_gemm_tuned.TUNED.get((n, k), {})
        bucket = row_bucket(m)
        if bucket in tuned:
            return None if tuned[bucket] is None else Fp8GemmConfig(**tuned[bucket])
        if m > MAX_ROWS:
            return None
    return default_config(m, n, k, sms)
