"""Benchmark: the paged decode-attention kernel alone, default launch settings vs a sweep (GPU).

For decode shapes of the engine benchmarks (bench/rollout.py: B=256 at the 0.5B and 7B shapes over a
128-token prompt + 512 new tokens, i.e. ~384 tokens of context on average; 7B at OpenRLHF's default 1,024 +
1,024 tokens, ~1,536; and the long-generation batch,
512 sequences of 512 + 4,096 tokens, ~2,560 on average; and 8 sequences in a CUDA graph, whose block
tables are as wide as the longest allowed sequence, where context splits matter) it times ``paged_decode_attention`` on random
bf16 queries and paged caches with shuffled pages (several, read in turn, so that L2 holds none of
them), replayed from a CUDA graph (kernel time, no launch overhead), and reports the bytes it must read (every live key and value once) per second, and the time
with the context unsplit (``ms_one_split``). With
``--sweep`` it also times every ``Tiles`` setting × context split count of a small grid, checks each
output against the default's, and reports the fastest (and every point, ``grid``: block_n, warps, stages,
maxnreg, splits, ms).

    python bench/decode_attention.py --sweep     # one JSON line
    python bench/decode_attention.py --kv_cache_dtype fp8 --sweep --shapes 7b_b256
    python bench/decode_attention.py --kv_cache_dtype fp8 --shapes 7b_b256 --cuda_settings 4,2,4,1 4,3,1,1

``--kv_cache_dtype fp8``: the caches hold e4m3 rows and their float32 scales (``runner/kv_cache.py``), the
bytes read count one per element and four per row, and ``bf16_ms`` is the default launch over the same
values in bf16 (the same run: the speed-up an FP8 cache gives this kernel). The default over an FP8 cache
is the CUDA kernel (``kernels/cuda_fp8_decode.py``) where it covers the shape; ``triton_ms`` times the
Triton kernel over the same values (and ``triton_vs_default`` the largest difference of their outputs), and
``--cuda_settings`` times other builds of the CUDA kernel (``--sweep`` always times the Triton kernel).

Context lengths are uniform in [avg/2, 3*avg/2] so splits see ragged rows, as in a batch of mixed prompts;
``--same_lengths`` gives every row the average (one prompt length, as ``bench/fp8_rollout.py``'s batches).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name: (batch, kv heads, query heads per kv head, head dim, average context[, block-table width in tokens])
SHAPES = {
    "0.5b_b256": (256, 2, 7, 64, 384),
    "0.5b_b256_ctx160": (256, 2, 7, 64, 160),  # the first decode steps of that benchmark
    "0.5b_b256_ctx608": (256, 2, 7, 64, 608),  # its last ones
    "7b_b256": (256, 4, 7, 128, 384),
    "7b_b256_ctx1536": (256, 4, 7, 128, 1536),  # OpenRLHF's default lengths: 1,024-token prompts + 1,024 new
    "0.5b_long_b512": (512, 2, 7, 64, 2560),
    # a few sequences (an agent, a chat server) in a CUDA graph, whose tables are as wide as max_model_len
    "0.5b_b8_graph": (8, 2, 7, 64, 384, 8192),
    "7b_b8_graph": (8, 4, 7, 128, 2048, 32768),
}
BLOCK_SIZE = 16
L2_BYTES = 50 * 2**20
MAX_COPIES = 20  # = kernel_ms' calls per graph
# The sweep's grid (``--grid_*`` replace an axis): Tiles(block_n, num_warps, num_stages, maxnreg) x context
# splits; maxnreg 0: no register cap (the FP8 cache's default is ``FP8_MAXNREG``, from this sweep).
GRID = {
    "block_n": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (1, 2, 3),
    "maxnreg": (0,),
    "splits": (1, 2, 4, 8),
}


def make_inputs(batch, kv_heads, group, dim, avg, table_tokens=0, seed=0, fp8=False, same_lengths=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(avg // 2, avg * 3 // 2 + 1, (batch,), generator=g, device="cuda")
    if same_lengths:
        lens.fill_(avg)
    width = max(int(lens.max()) // BLOCK_SIZE + 1, table_tokens // BLOCK_SIZE)
    blocks = batch * width
    perm = torch.randperm(blocks, generator=g, device="cuda")
    tables = perm.view(batch, width).to(torch.int32)
    shape = (2, blocks, BLOCK_SIZE, kv_heads, dim)
    # Several caches, used in turn, ~4x the GPU's L2 cache in all: one cache read over and over would be
    # served partly from L2 (H200: 50 MB, more than a 0.5B-shape layer's keys and values), which no
    # engine layer enjoys (each reads its own cache once a step).
    copies = max(1, min(MAX_COPIES, -(-L2_BYTES * 4 // (2 * torch.Size(shape).numel()))))
    if fp8:  # half the bytes: twice the copies to stay ~4x past L2
        copies = min(MAX_COPIES, 2 * copies)
    caches = [torch.randn(shape, generator=g, device="cuda").bfloat16() for _ in range(copies)]
    q = torch.randn(batch, kv_heads * group, dim, generator=g, device="cuda").bfloat16()
    return q, caches, tables, lens.to(torch.int32)


def kernel_ms(fn, calls: int = 20, replays: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def fp8_caches(caches: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each bf16 cache as the FP8 cache stores it: (e4m3 rows, their float32 scales)."""
    from tidal.rollout.runner.kv_cache import quantize_heads

    out = []
    for cache in caches:
        q, scales = quantize_heads(cache.view(-1, *cache.shape[-2:]))
        out.append((q.view(cache.shape), scales.view(cache.shape[:-1]).contiguous()))
    return out


def fp8_kernels(run, reference: torch.Tensor, cuda_settings) -> dict:
    """The FP8 cache's two kernels over the same inputs: the Triton one's time and how far its output is
    from the default's (the CUDA kernel, where it covers the shape), and each CUDA (warps, stages, ...)
    setting of ``cuda_settings``."""
    from tidal.rollout.kernels import cuda_fp8_decode as cfd
    from tidal.rollout.kernels import triton_attention as ta

    ta.FP8_CUDA_KERNEL = False
    try:
        triton_out = run()()
        out = {"triton_ms": round(kernel_ms(run()), 4)}
    finally:
        ta.FP8_CUDA_KERNEL = True
    out["triton_vs_default"] = round(float((triton_out.float() - reference.float()).abs().max()), 5)
    names = ("WARPS", "STAGES", "MIN_BLOCKS", "HEADS_FIRST")
    default = [getattr(cfd, n) for n in names]
    for setting in cuda_settings:
        for name, value in zip(names, setting, strict=False):
            setattr(cfd, name, value)
        try:
            err = float((run()().float() - reference.float()).abs().max())
            out.setdefault("cuda", []).append([*setting, round(kernel_ms(run()), 4), round(err, 5)])
        finally:
            for name, value in zip(names, default, strict=True):
                setattr(cfd, name, value)
    return out


def measure(
    name: str, sweep: bool, grid: dict | None = None, fp8: bool = False, cuda_settings=(), same_lengths=False
) -> dict:
    from tidal.accel import sm_count
    from tidal.rollout.kernels import triton_attention as ta

    batch, kv_heads, group, dim, avg, *table_tokens = SHAPES[name]
    q, caches, tables, lens = make_inputs(
        batch, kv_heads, group, dim, avg, *table_tokens, fp8=fp8, same_lengths=same_lengths
    )
    scale = dim**-0.5
    per_row = dim + 4 if fp8 else dim * 2  # bytes of one key or value row (FP8: its scale too)
    gb = float(lens.sum()) * kv_heads * per_row * 2 / 1e9
    pairs = fp8_caches(caches) if fp8 else [(cache, None) for cache in caches]

    def run(tiles=None, splits=None):
        turn = itertools.cycle(pairs)  # each call (each captured one too) reads the next cache

        def call():
            cache, scales = next(turn)
            return ta.paged_decode_attention(
                q, cache, tables, lens, None, scale, splits, tiles, kv_scales=scales
            )

        return call

    auto = ta.choose_num_splits(
        batch, kv_heads, tables.shape[1] * BLOCK_SIZE, sm_count(torch.device("cuda", 0))
    )
    reference = run()()
    base = kernel_ms(run())
    result = {
        "shape": name,
        "gb": round(gb, 3),
        "splits": auto,
        "ms": round(base, 4),
        "tb_s": round(gb / base, 2),
        "ms_one_split": round(kernel_ms(run(splits=1)), 4),
        "caches": len(caches),
    }
    if fp8:
        turn = itertools.cycle(caches)
        result["bf16_ms"] = round(
            kernel_ms(lambda: ta.paged_decode_attention(q, next(turn), tables, lens, None, scale)), 4
        )
        result.update(fp8_kernels(run, reference, cuda_settings))
    if not sweep:
        return result
    best = (base, ta.TILES, auto)
    by_splits: dict[int, float] = {}  # the fastest tiles at each split count
    grid = grid or GRID
    for block_n, warps, stages, maxnreg, splits in itertools.product(*(grid[k] for k in GRID)):
        tiles = ta.Tiles(block_n, warps, stages, maxnreg)
        try:
            out = run(tiles, splits)()
        except Exception as err:  # noqa: BLE001 - a launch Triton cannot compile (shared memory, fp8 dots)
            result.setdefault("failed", []).append(f"{tiles} splits={splits}: {type(err).__name__}")
            continue
        err = float((out.float() - reference.float()).abs().max())
        if err > 3e-2:
            raise SystemExit(f"{name}: {tiles} splits={splits} differs from the default by {err}")
        ms = kernel_ms(run(tiles, splits))
        result.setdefault("grid", []).append([block_n, warps, stages, maxnreg, splits, round(ms, 4)])
        by_splits[splits] = min(by_splits.get(splits, ms), ms)
        if ms < best[0]:
            best = (ms, tiles, splits)
    ms, tiles, splits = best
    result["best"] = {"ms": round(ms, 4), "tb_s": round(gb / ms, 2), "splits": splits, **tiles.__dict__}
    result["best_ms_by_splits"] = {k: round(v, 4) for k, v in sorted(by_splits.items())}
    return result


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--kv_cache_dtype", default="auto", choices=["auto", "fp8"], help="fp8: an FP8 cache")
    p.add_argument("--same_lengths", action="store_true", help="every row at the shape's average context")
    p.add_argument(
        "--cuda_settings", nargs="*", default=[], metavar="W,P,B,H",
        help="FP8 cache: also time the CUDA kernel with these (warps, pipeline stages, min CTAs an SM, kv heads "
        "first) settings, e.g. 4,1,1,0 4,0,4,1",
    )  # fmt: skip
    for axis, values in GRID.items():
        p.add_argument(f"--grid_{axis}", type=int, nargs="+", default=list(values), help="a sweep axis")
    args = p.parse_args(argv)
    grid = {axis: tuple(getattr(args, f"grid_{axis}")) for axis in GRID}
    cuda_settings = [tuple(int(x) for x in s.split(",")) for s in args.cuda_settings]
    fp8 = args.kv_cache_dtype == "fp8"
    results = [measure(name, args.sweep, grid, fp8, cuda_settings, args.same_lengths) for name in args.shapes]
    print(json.dumps({"bench": "decode_attention", "gpu": torch.cuda.get_device_name(), "runs": results}))
    return results


if __name__ == "__main__":
    main()
