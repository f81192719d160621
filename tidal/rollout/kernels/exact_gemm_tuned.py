"""Launches of exact mode's GEMM measured best per weight shape (``triton_exact.matmul_config`` reads them;
shapes not listed take its rule). Written by ``bench/exact_matmul.py --write``; no shape measured yet.

Any launch keeps engine and trainer bit-equal (both pick it from the weight's shape); a table entry only
changes speed, and the bits of every shape it lists (so it changes exact runs' samples, not their exactness).
"""

# (N, K) -> MatmulConfig fields
TUNED: dict[tuple[int, int], dict[str, int]] = {}
