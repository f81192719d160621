"""Launches of the FP8 linear layers' Triton GEMM (``triton_fp8_gemm``) measured best per weight shape and
token bucket, against ``torch._scaled_mm`` (``None``: torch's GEMM was faster there). Shapes and buckets
not listed take ``fp8_gemm_config.default_config`` up to ``MAX_ROWS`` tokens.

Written by ``bench/fp8_gemm.py --search --write`` (last: qwen2.5-0.5b, NVIDIA H200, torch 2.11.0+cu130, 2026-12-04).
"""

# (N, K) -> {token bucket: Fp8GemmConfig fields, or None for torch._scaled_mm}
# fmt: off
TUNED: dict[tuple[int, int], dict[int, dict[str, int] | None]] = {
    (896, 896): {256: {'block_m': 64, 'block_n': 64, 'block_k': 256, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'tma': 1}, 64: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}},
    (896, 4864): {256: {'block_m': 64, 'block_n': 64, 'block_k': 256, 'split_k': 2, 'num_warps': 4, 'num_stages': 4, 'tma': 1}, 64: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 8, 'num_warps': 4, 'num_stages': 3}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 8, 'num_warps': 4, 'num_stages': 3}},
    (1152, 896): {256: {'block_m': 64, 'block_n': 64, 'block_k': 256, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'tma': 1}, 64: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}},
    (3584, 3584): {256: {'block_m': 64, 'block_n': 128, 'block_k': 256, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'tma': 1}, 64: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 2, 'num_warps': 4, 'num_stages': 3}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 4, 'num_warps': 4, 'num_stages': 3}},
    (3584, 18944): {256: {'block_m': 64, 'block_n': 128, 'block_k': 256, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'tma': 1}, 64: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 4, 'num_warps': 4, 'num_stages': 4}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 8, 'num_warps': 4, 'num_stages': 3}},
    (4608, 3584): {256: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 4, 'tma': 1}, 64: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 4, 'num_warps': 4, 'num_stages': 3}},
    (9728, 896): {256: {'block_m': 64, 'block_n': 128, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3, 'tma': 1}, 64: {'block_m': 64, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}},
    (37888, 3584): {256: None, 64: {'block_m': 64, 'block_n': 128, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}, 16: {'block_m': 16, 'block_n': 64, 'block_k': 128, 'split_k': 1, 'num_warps': 4, 'num_stages': 3}},
}
# fmt: on
