"""Launches of exact mode's GEMM measured best per weight shape (``triton_exact.matmul_config`` reads them;
shapes not listed take its rule).

Written by ``bench/exact_matmul.py --write`` (last: qwen2.5-0.5b and qwen2.5-7b, NVIDIA H200, torch 2.11.0+cu130, 2026-12-02).

Any launch keeps engine and trainer bit-equal (both pick it from the weight's shape); a table entry only
changes speed, and the bits of every shape it lists (so it changes exact runs' samples, not their exactness).
"""

# (N, K) -> MatmulConfig fields
# fmt: off
TUNED: dict[tuple[int, int], dict[str, int]] = {
    (128, 896): {"block_n": 64, "num_warps": 8, "num_stages": 3, "block_m": 128, "block_k": 64, "group_m": 8},
    (512, 3584): {"block_n": 64, "num_warps": 4, "num_stages": 5, "block_m": 64, "block_k": 64, "group_m": 8},
    (896, 896): {"block_n": 128, "num_warps": 8, "num_stages": 3, "block_m": 128, "block_k": 64, "group_m": 8},
    (896, 4864): {"block_n": 64, "num_warps": 8, "num_stages": 3, "block_m": 128, "block_k": 64, "group_m": 8},
    (3584, 3584): {"block_n": 64, "num_warps": 8, "num_stages": 3, "block_m": 128, "block_k": 64, "group_m": 8},
    (3584, 18944): {"block_n": 64, "num_warps": 8, "num_stages": 4, "block_m": 128, "block_k": 128, "group_m": 8},
    (4864, 896): {"block_n": 64, "num_warps": 8, "num_stages": 4, "block_m": 128, "block_k": 64, "group_m": 8},
    (18944, 3584): {"block_n": 256, "num_warps": 8, "num_stages": 4, "block_m": 128, "block_k": 64, "group_m": 8},
    (151936, 896): {"block_n": 256, "num_warps": 8, "num_stages": 4, "block_m": 128, "block_k": 64, "group_m": 8},
    (152064, 3584): {"block_n": 256, "num_warps": 8, "num_stages": 4, "block_m": 128, "block_k": 64, "group_m": 8},
}
# fmt: on
