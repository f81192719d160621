"""Launches of exact mode's GEMM measured best per weight shape, one for the trainer's rows (``train``:
``triton_exact.matmul_config``) and one for a decode step's (``decode``: ``triton_exact.decode_config``),
and the K partition per reduction length (``K_SPLITS``: the number of K ranges, the same for both
launches). Shapes not listed take ``matmul_config``'s rule.

Written by ``bench/exact_matmul.py --write`` (last: qwen2.5-7b, NVIDIA H200, torch 2.11.0+cu130, 2026-12-03).

A tile keeps engine and trainer bit-equal (the decode tile once ``verify_decode_launch`` has seen it give
the train tile's bits on the GPU at hand); a ``K_SPLITS`` entry changes the bits of every weight of that
K, on both sides alike (so it changes exact runs' samples, not their exactness).
"""

# (N, K) -> {"train" | "decode": MatmulConfig fields but splits}
# fmt: off
TUNED: dict[tuple[int, int], dict[str, dict[str, int]]] = {
    (128, 896): {"train": {"block_k": 64, "block_m": 64, "block_n": 64, "group_m": 8, "num_stages": 3, "num_warps": 4}},
    (512, 3584): {"train": {"block_k": 128, "block_m": 128, "block_n": 128, "group_m": 8, "num_stages": 3, "num_warps": 8}},
    (896, 896): {"decode": {"block_k": 128, "block_m": 64, "block_n": 32, "group_m": 8, "num_stages": 4, "num_warps": 4, "tma": 1}, "train": {"block_k": 64, "block_m": 128, "block_n": 64, "group_m": 8, "num_stages": 4, "num_warps": 8}},
    (896, 4864): {"decode": {"block_k": 128, "block_m": 64, "block_n": 32, "group_m": 8, "num_stages": 4, "num_warps": 4, "tma": 1}, "train": {"block_k": 128, "block_m": 128, "block_n": 128, "group_m": 8, "num_stages": 3, "num_warps": 8}},
    (1152, 896): {"decode": {"block_k": 128, "block_m": 64, "block_n": 64, "group_m": 8, "num_stages": 4, "num_warps": 4, "tma": 1}},
    (3584, 3584): {"decode": {"block_k": 128, "block_m": 128, "block_n": 64, "group_m": 8, "num_stages": 4, "num_warps": 8, "tma": 1}, "train": {"block_k": 64, "block_m": 128, "block_n": 256, "group_m": 8, "num_stages": 4, "num_warps": 8}},
    (3584, 18944): {"decode": {"block_k": 128, "block_m": 128, "block_n": 64, "group_m": 8, "num_stages": 4, "num_warps": 8, "tma": 1}, "train": {"block_k": 64, "block_m": 128, "block_n": 256, "group_m": 8, "num_stages": 4, "num_warps": 8}},
    (4608, 3584): {"decode": {"block_k": 64, "block_m": 64, "block_n": 64, "group_m": 8, "num_stages": 4, "num_warps": 4, "tma": 1}},
    (4864, 896): {"train": {"block_k": 64, "block_m": 128, "block_n": 256, "group_m": 8, "num_stages": 4, "num_warps": 8}},
    (9728, 896): {"decode": {"block_k": 64, "block_m": 64, "block_n": 128, "group_m": 8, "num_stages": 3, "num_warps": 4, "tma": 1}},
    (18944, 3584): {"train": {"block_k": 64, "block_m": 128, "block_n": 256, "group_m": 8, "num_stages": 4, "num_warps": 8}},
    (37888, 3584): {"decode": {"block_k": 64, "block_m": 128, "block_n": 128, "group_m": 8, "num_stages": 4, "num_warps": 8, "tma": 1}},
    (151936, 896): {"decode": {"block_k": 64, "block_m": 128, "block_n": 128, "group_m": 8, "num_stages": 3, "num_warps": 8, "tma": 0}, "train": {"block_k": 64, "block_m": 128, "block_n": 256, "group_m": 8, "num_stages": 4, "num_warps": 8}},
    (152064, 3584): {"decode": {"block_k": 64, "block_m": 128, "block_n": 256, "group_m": 8, "num_stages": 4, "num_warps": 8, "tma": 1}, "train": {"block_k": 64, "block_m": 128, "block_n": 256, "group_m": 8, "num_stages": 4, "num_warps": 8}},
}
K_SPLITS: dict[int, int] = {896: 1, 3584: 1, 4864: 1, 18944: 1}  # K -> number of K ranges (1 where not listed)
# fmt: on
