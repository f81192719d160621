"""Launches of the FP8 linear layers' Triton GEMM (``triton_fp8_gemm``) measured best per weight shape and
token bucket, against ``torch._scaled_mm`` (``None``: torch's GEMM was faster there). Shapes and buckets
not listed take ``triton_fp8_gemm.default_config`` up to ``MAX_ROWS`` tokens.

Written by ``bench/fp8_gemm.py --search --write`` (not yet run).
"""

# (N, K) -> {token bucket: Fp8GemmConfig fields, or None for torch._scaled_mm}
# fmt: off
TUNED: dict[tuple[int, int], dict[int, dict[str, int] | None]] = {}
# fmt: on
