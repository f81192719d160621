"""Benchmark (issue #34): launches of exact mode's batch-invariant GEMM (``triton_exact.matmul``) per weight
shape, against cuBLAS (``torch.nn.functional.linear``, which is not batch-invariant) in the same run.

Two sets of launches per model shape (``--config``):

- the trainer's: each layer's weight alone (q/o, k/v, gate/up, down; lm_head once) at a micro-batch's
  rows (``--train_rows``), timed back to back (long enough that host latency hides);
- the engine's decode step: q/k/v and gate/up packed into one launch each, o, down and lm_head, at
  ``--decode_rows``, timed as GPU time (the calls replayed from a CUDA graph, as the decode step runs).

Each launch's tile is searched in two rounds (tile and K step, then pipeline depth around the best two;
at decode also K splits, and TMA loads against pointer loads). A column's bits depend only on the K partition (``triton_exact.matmul_config``),
so the two sets take their own tiles, and the K partition is chosen per reduction length K: the split
count that makes the decode step's launches of that K fastest (a trainer's launch walks the ranges in
turn in one program, at about the unsplit cost). Every chosen decode launch is then checked as the engine
checks it (``verify_decode_launch``: its columns give each part's trainer-launch bits). Prints a table to
stderr and one JSON line: per launch cuBLAS's, the current table's and the best times, and the totals
per decode step and per trainer forward. ``--write`` records the launches and K partitions in
``tidal/rollout/kernels/exact_gemm_tuned.py``.

    python bench/exact_matmul.py --config qwen2.5-0.5b          # one H200: ~4 minutes (compiles)
    python bench/exact_matmul.py --config qwen2.5-7b --train_rows 4096
    python bench/exact_matmul.py --config qwen2.5-0.5b --decode_only   # the engine's launches alone
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import versions  # noqa: E402

# hidden, k/v width (heads x head dim), intermediate, vocabulary, layers
SHAPES = {
    "qwen2.5-0.5b": (896, 128, 4864, 151936, 24),
    "qwen2.5-7b": (3584, 512, 18944, 152064, 28),
}


def train_launches(config: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, count per forward): the trainer's separate layers."""
    h, kv, inter, vocab, layers = SHAPES[config]
    return {
        "q/o": (h, h, 2 * layers),
        "k/v": (kv, h, 2 * layers),
        "gate/up": (inter, h, 2 * layers),
        "down": (h, inter, layers),
        "lm_head": (vocab, h, 1),
    }


def decode_launches(config: str) -> dict[str, tuple[int, int, int, list[int]]]:
    """name -> (N, K, count per decode step, parts): the engine's launches, q/k/v and gate/up packed."""
    h, kv, inter, vocab, layers = SHAPES[config]
    return {
        "qkv": (h + 2 * kv, h, layers, [h, kv, kv]),
        "o": (h, h, layers, [h]),
        "gate_up": (2 * inter, h, layers, [inter, inter]),
        "down": (h, inter, layers, [h]),
        "lm_head": (vocab, h, 1, [vocab]),
    }


def time_ms(fn, repeats: int) -> float:
    """Milliseconds a call, launched back to back (host launch latency included where it exceeds the GPU
    time: use ``graph_time_ms`` for launches shorter than that)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def graph_time_ms(fn, repeats: int) -> float:
    """GPU time per call of ``fn``, replayed from one CUDA graph of ``repeats`` calls (the engine decodes
    in CUDA graphs; timed eagerly, the host's launch time of a small kernel, ~0.01-0.1 ms a call, would
    hide the kernels' own)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compiles, cuBLAS/CUTLASS selection, allocator pools
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def candidates(n: int, make, decode: bool):
    """Round one: tile shapes and K steps (3 stages, K not split, pointer loads). At decode also tiles of
    128 rows on one warpgroup and of the whole 256-row batch (each weight tile read once)."""
    tiles = [(64, 4), (128, 8)]  # (block_m, warps): one or two warpgroups of m64 MMAs
    if decode:
        tiles += [(128, 4), (256, 8)]
    widths = (32, 64, 128) if n <= 1024 else (64, 128, 256)
    for (bm, warps), bn, bk in itertools.product(tiles, widths, (64, 128)):
        yield make(block_m=bm, num_warps=warps, block_n=bn, block_k=bk, num_stages=3)


class Search:
    """Timed launches of one weight shape at one row count (decode: from a CUDA graph)."""

    def __init__(self, te, x, w, decode: bool, repeats: int):
        self.te, self.x, self.w, self.decode, self.repeats = te, x, w, decode, repeats
        self.times: dict = {}
        self.failed: dict = {}  # launch -> why it could not run (over the GPU's resources, TMA refused)

    def time(self, config) -> float | None:
        if config not in self.times:
            fn = lambda: self.te.matmul(self.x, self.w, config=config)  # noqa: E731
            try:
                fn()
                self.times[config] = (
                    graph_time_ms(fn, self.repeats) if self.decode else time_ms(fn, max(3, self.repeats // 4))
                )
            except Exception as err:  # noqa: BLE001  (a launch that cannot run here is not a candidate)
                self.times[config] = None
                self.failed[config] = f"{type(err).__name__}: {str(err)[:160]}"
        return self.times[config]

    def best(self, configs, deadline: float):
        for c in configs:
            if time.time() < deadline:
                self.time(c)
        timed = [c for c in configs if self.times.get(c) is not None]
        return sorted(timed, key=self.times.get)


def search_tile(te, n, k, rows, decode, args, deadline, g, splits_options=(1,)):
    """Per K-split count: the fastest launch found for a weight ``[n, k]`` at ``rows`` rows (the current
    table's launch always timed)."""
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    s = Search(te, x, w, decode, args.repeats)
    current = te.decode_config(n, k) if decode else te.matmul_config(n, k)
    s.time(current)
    round_one = s.best(list(candidates(n, te.MatmulConfig, decode)), deadline)[:2] or [current]
    stages = (3, 4) if decode else (3, 4, 5)
    loads = (0, 1) if decode else (0,)  # pointer loads, TMA
    round_two = [
        dataclasses.replace(c, num_stages=st, splits=sp, tma=tma)
        for c in round_one
        for st, sp, tma in itertools.product(stages, splits_options, loads)
    ]
    s.best(round_two, deadline)
    best = {}
    for c, t in s.times.items():
        if t is not None and (c.splits not in best or t < s.times[best[c.splits]]):
            best[c.splits] = c
    cublas = (graph_time_ms if decode else time_ms)(lambda: torch.nn.functional.linear(x, w), args.repeats)
    return {
        "current": current,
        "current_ms": s.times[current],
        "best": best,
        "times": s.times,
        "failed": {str(dataclasses.asdict(c)): why for c, why in s.failed.items()},
        "cublas_ms": cublas,
    }


def agree(te, n, k, parts, decode_cfg, train_cfgs, g) -> bool:
    """What ``verify_decode_launch`` checks (``triton_exact.launch_keeps_bits``), for the launches found
    here: the decode launch's columns give each part's trainer-launch bits."""
    x = torch.randn(64, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    return te.launch_keeps_bits(x, w, parts, decode_cfg, train_cfgs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--decode_rows", type=int, default=256)
    p.add_argument("--train_rows", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--deadline_s", type=float, default=400.0, help="stop searching after this long")
    p.add_argument(
        "--decode_only",
        action="store_true",
        help="search the decode launches only (K unsplit, as the trainer's launches are kept)",
    )
    p.add_argument("--write", action="store_true",
                   help="record the launches and K partitions in tidal/rollout/kernels/exact_gemm_tuned.py "
                        "(kept: the other shapes already there)")  # fmt: skip
    args = p.parse_args()
    from tidal.rollout.kernels import triton_exact as te

    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    train_shapes, decode_shapes = train_launches(args.config), decode_launches(args.config)
    if args.decode_only:
        if any(te.K_SPLITS.get(k, 1) != 1 for _, k, _, _ in decode_shapes.values()):
            p.error("--decode_only searches unsplit launches; this shape's K_SPLITS split K")
        train_shapes = {}
    per_shape = args.deadline_s / (len(train_shapes) + 2 * len(decode_shapes))
    train = {}
    for name, (n, k, _count) in train_shapes.items():
        train[name] = search_tile(te, n, k, args.train_rows, False, args, time.time() + per_shape, g)
    decode = {}
    split_options = (1,) if args.decode_only else (1, 2, 4)
    for name, (n, k, _count, _) in decode_shapes.items():
        decode[name] = search_tile(
            te, n, k, args.decode_rows, True, args, time.time() + 2 * per_shape, g, split_options
        )
    # the K partition per K: the split count whose decode launches of that K are fastest in all
    splits = {}
    for k in sorted({k for n, k, _, _ in decode_shapes.values()}):
        if args.decode_only:
            splits[k] = 1
            continue
        names = [nm for nm, (_, kk, _, _) in decode_shapes.items() if kk == k]
        common = set.intersection(*(set(decode[nm]["best"]) for nm in names))
        cost = {
            sp: sum(decode_shapes[nm][2] * decode[nm]["times"][decode[nm]["best"][sp]] for nm in names)
            for sp in common
        }
        splits[k] = min(cost, key=cost.get)
    rows, table = {}, {}
    for name, (n, k, count) in train_shapes.items():
        r = train[name]
        tile = dataclasses.replace(r["best"][1], splits=splits.get(k, 1))
        search = Search(te, *_inputs(n, k, args.train_rows, g), False, args.repeats)
        rows["train " + name] = _row(n, k, count, r, tile, search.time(tile))
        table.setdefault((n, k), {})["train"] = tile
    for name, (n, k, count, parts) in decode_shapes.items():
        r = decode[name]
        tile = r["best"][splits[k]]
        train_cfgs = [table.get((size, k), {}).get("train") or te.matmul_config(size, k) for size in parts]
        train_cfgs = [dataclasses.replace(c, splits=splits[k]) for c in train_cfgs]
        row = _row(n, k, count, r, tile, r["times"][tile])
        row["agrees"] = agree(te, n, k, parts, tile, train_cfgs, g)
        rows["decode " + name] = row
        if row["agrees"]:
            table.setdefault((n, k), {})["decode"] = tile
    for name, r in rows.items():
        print(f"{name:16s} N={r['n']:6d} K={r['k']:5d} ms cublas {r['cublas_ms']:.4f} current {r['current_ms']:.4f} "
              f"best {r['best_ms']:.4f} | {r['best']}", file=sys.stderr)  # fmt: skip
    totals = {
        which: {
            regime: sum(r["count"] * r[f"{which}_ms"] for nm, r in rows.items() if nm.startswith(regime))
            for regime in ("decode", "train")
        }
        for which in ("cublas", "current", "best")
    }
    out = {"bench": "exact_matmul", **versions(), "config": args.config, "decode_rows": args.decode_rows,
           "train_rows": args.train_rows, "k_splits": splits, "totals_ms": totals, "launches": rows,
           "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    if args.write:
        write_table(table, splits, out)
    print(json.dumps(out))


def _inputs(n, k, rows, g):
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    return x, (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()


def _row(n, k, count, r, tile, best_ms) -> dict:
    fields = {f: v for f, v in dataclasses.asdict(tile).items()}
    return {"n": n, "k": k, "count": count, "cublas_ms": r["cublas_ms"], "current_ms": r["current_ms"] or 0.0,
            "current": dataclasses.asdict(r["current"]), "best_ms": best_ms, "best": fields}  # fmt: skip


def write_table(table: dict, splits: dict, info: dict) -> None:
    """Merge ``table`` ((N, K) -> {"train" | "decode": launch}) and ``splits`` (K -> ranges) into
    ``exact_gemm_tuned`` and rewrite that module."""
    from tidal.rollout.kernels import exact_gemm_tuned

    merged = {key: dict(entry) for key, entry in exact_gemm_tuned.TUNED.items()}
    for key, entry in table.items():
        for regime, cfg in entry.items():
            fields = dataclasses.asdict(cfg)
            fields.pop("splits")
            merged.setdefault(key, {})[regime] = fields
    k_splits = {**exact_gemm_tuned.K_SPLITS, **splits}
    path = Path(exact_gemm_tuned.__file__)
    doc = exact_gemm_tuned.__doc__.split("Written by")[0].rstrip()
    lines = [f"    ({n}, {k}): {json.dumps(e, sort_keys=True)}," for (n, k), e in sorted(merged.items())]
    when = f"{info.get('gpu', 'cpu')}, torch {info['torch']}, {time.strftime('%Y-%m-%d')}"
    path.write_text(
        f'"""{doc}\n\nWritten by ``bench/exact_matmul.py --write`` (last: {info["config"]}, {when}).\n\n'
        + exact_gemm_tuned.__doc__.split("\n\n", 2)[2].rstrip()
        + '\n"""\n\n# (N, K) -> {"train" | "decode": MatmulConfig fields but splits}\n# fmt: off\n'
        + "TUNED: dict[tuple[int, int], dict[str, dict[str, int]]] = {\n"
        + "\n".join(lines)
        + "\n}\n"
        + f"K_SPLITS: dict[int, int] = { {int(k): v for k, v in sorted(k_splits.items())} }"
        + "  # K -> number of K ranges (1 where not listed)\n# fmt: on\n"
    )


if __name__ == "__main__":
    main()
