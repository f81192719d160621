"""Benchmark (issue #34): launches of exact mode's batch-invariant GEMM (``triton_exact.matmul``) per weight
shape, against cuBLAS (``torch.nn.functional.linear``, which is not batch-invariant) in the same run.

For each weight ``[N, K]`` of a model shape (``--config``: q, k/v, o, gate/up, down per layer; lm_head
once) the GEMM runs at a decode step's rows (``--decode_rows``) and at a trainer micro-batch's
(``--train_rows``). Candidate launches (tile, K step, warps, stages, K splits) are searched in two rounds
(tiles first, then pipeline depth and K splits around the best two); decode times are GPU times (the
calls replayed from a CUDA graph, as the engine's decode step runs), trainer times back-to-back launches
(long enough that host latency hides); a launch is scored by the time a
whole decode step and a whole trainer forward spend in that shape (times the layer count), and is kept
only if a row's bits do not depend on the row count (the decode rows, alone, give the bits they get among
the trainer's rows). Prints a table to stderr and one JSON line: per shape cuBLAS's, ``matmul_config``'s
and the best launch's times, and the totals per decode step and per trainer forward.

    python bench/exact_matmul.py --config qwen2.5-0.5b          # one H200: ~2 minutes (compiles)
    python bench/exact_matmul.py --config qwen2.5-7b --train_rows 4096
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


def weights(config: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, count per forward)."""
    h, kv, inter, vocab, layers = SHAPES[config]
    return {
        "q/o": (h, h, 2 * layers),
        "k/v": (kv, h, 2 * layers),
        "gate/up": (inter, h, 2 * layers),
        "down": (h, inter, layers),
        "lm_head": (vocab, h, 1),
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
    """Milliseconds a call's GPU work takes, ``repeats`` calls captured in one CUDA graph and replayed (the
    engine's decode step runs in a graph: no host launch latency between its GEMMs)."""
    fn()
    torch.cuda.synchronize()
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
    del graph
    return start.elapsed_time(end) / repeats


def candidates(n: int, make):
    """Round one: tile shapes and K steps (3 stages, K not split)."""
    tiles = [(64, 4), (128, 8)]  # (block_m, warps): one or two warpgroups of m64 MMAs
    widths = (32, 64, 128) if n <= 1024 else (64, 128, 256)
    for (bm, warps), bn, bk in itertools.product(tiles, widths, (64, 128)):
        yield make(block_m=bm, num_warps=warps, block_n=bn, block_k=bk, num_stages=3)


def refinements(best):
    """Round two, around one of round one's best: pipeline depth and K splits (ranges in parallel programs
    at decode's rows, in turn in one program at the trainer's: the same bits)."""
    for stages, splits in itertools.product((3, 4, 5), (1, 2, 4, 8)):
        yield dataclasses.replace(best, num_stages=stages, splits=splits)


def score(te, x_dec, x_tr, w, count, config, repeats) -> dict | None:
    try:
        full = te.matmul(x_tr, w, config=config)
        alone = te.matmul(x_dec, w, config=config)
    except Exception as err:  # a launch that does not fit (shared memory): not a candidate
        return {"error": type(err).__name__}
    if not torch.equal(alone, full[: x_dec.shape[0]]):
        return {"invariant": False}
    dec = graph_time_ms(lambda: te.matmul(x_dec, w, config=config), repeats)
    tr = time_ms(lambda: te.matmul(x_tr, w, config=config), max(3, repeats // 4))
    return {"invariant": True, "decode_ms": dec, "train_ms": tr, "step_ms": count * dec, "fwd_ms": count * tr}


def search(te, n: int, k: int, count: int, args, t0: float, g) -> dict:
    """cuBLAS, ``matmul_config``'s launch and the best candidate for one weight shape."""
    x_tr = torch.randn(args.train_rows, k, device="cuda", generator=g).bfloat16()
    x_dec = x_tr[: args.decode_rows].clone()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    cublas = {
        "decode_ms": graph_time_ms(lambda: torch.nn.functional.linear(x_dec, w), args.repeats),
        "train_ms": time_ms(lambda: torch.nn.functional.linear(x_tr, w), max(3, args.repeats // 4)),
    }
    current = te.matmul_config(n, k)
    results = {current: score(te, x_dec, x_tr, w, count, current, args.repeats)}

    def key(c):  # a GRPO step's time in this weight's GEMMs
        return args.decode_steps * results[c]["step_ms"] + args.train_forwards * results[c]["fwd_ms"]

    def run(configs):
        for c in configs:
            if time.time() - t0 < args.deadline_s and c not in results:
                results[c] = score(te, x_dec, x_tr, w, count, c, args.repeats)
        return sorted((c for c, r in results.items() if r.get("invariant")), key=key)

    for best in run(candidates(n, te.MatmulConfig))[:2]:
        run(refinements(best))
    best = run([])[0]
    return {
        "n": n, "k": k, "count": count, "cublas": cublas,
        "current": {"config": dataclasses.asdict(current), **results[current]},
        "best": {"config": dataclasses.asdict(best), **results[best]},
        "best_bits_equal_current": torch.equal(te.matmul(x_tr, w, config=best), te.matmul(x_tr, w, config=current)),
        "not_invariant": [dataclasses.asdict(c) for c, r in results.items() if r.get("invariant") is False],
        "errors": sum("error" in r for r in results.values()),
        "tried": len(results),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--decode_rows", type=int, default=256)
    p.add_argument("--train_rows", type=int, default=16384)
    p.add_argument("--decode_steps", type=int, default=256, help="decode steps a GRPO step (the score)")
    p.add_argument("--train_forwards", type=int, default=4,
                   help="trainer exact forwards of --train_rows a GRPO step (the score; the CLI's 0.5B step: "
                        "~82k tokens in micro-batches of 64 samples)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--deadline_s", type=float, default=400.0, help="stop searching after this long")
    p.add_argument("--write", action="store_true",
                   help="record each shape's best launch in tidal/rollout/kernels/exact_gemm_tuned.py (kept: "
                        "the other shapes already there)")  # fmt: skip
    args = p.parse_args()
    from tidal.rollout.kernels import triton_exact as te

    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = {}
    for name, (n, k, count) in weights(args.config).items():
        rows[name] = search(te, n, k, count, args, t0, g)
        r = rows[name]
        print(
            f"{name:8s} N={n:6d} K={k:5d} decode ms cublas {r['cublas']['decode_ms']:.4f} current "
            f"{r['current']['decode_ms']:.4f} best {r['best']['decode_ms']:.4f} | train ms cublas "
            f"{r['cublas']['train_ms']:.3f} current {r['current']['train_ms']:.3f} best {r['best']['train_ms']:.3f} "
            f"| best {r['best']['config']}",
            file=sys.stderr,
        )
    totals = {}
    for which in ("current", "best"):
        totals[which] = {
            "decode_step_ms": sum(r[which]["step_ms"] for r in rows.values()),
            "train_forward_ms": sum(r[which]["fwd_ms"] for r in rows.values()),
        }
    totals["cublas"] = {
        "decode_step_ms": sum(r["count"] * r["cublas"]["decode_ms"] for r in rows.values()),
        "train_forward_ms": sum(r["count"] * r["cublas"]["train_ms"] for r in rows.values()),
    }
    out = {"bench": "exact_matmul", **versions(), "config": args.config, "decode_rows": args.decode_rows,
           "train_rows": args.train_rows, "totals": totals, "shapes": rows, "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    if args.write:
        write_table({(r["n"], r["k"]): r["best"]["config"] for r in rows.values()}, out)
    print(json.dumps(out))


def write_table(best: dict, info: dict) -> None:
    """Merge ``best`` into ``exact_gemm_tuned.TUNED`` and rewrite that module."""
    from tidal.rollout.kernels import exact_gemm_tuned

    table = {**exact_gemm_tuned.TUNED, **best}
    path = Path(exact_gemm_tuned.__file__)
    doc = exact_gemm_tuned.__doc__.split("Written by")[0].rstrip()
    lines = [f"    ({n}, {k}): {json.dumps(c)}," for (n, k), c in sorted(table.items())]
    when = f"{info.get('gpu', 'cpu')}, torch {info['torch']}, {time.strftime('%Y-%m-%d')}"
    path.write_text(
        f'"""{doc}\n\nWritten by ``bench/exact_matmul.py --write`` (last: {info["config"]}, {when}).\n\n'
        + exact_gemm_tuned.__doc__.split("\n\n", 1)[1].rstrip()
        + '\n"""\n\n# (N, K) -> MatmulConfig fields\n# fmt: off\nTUNED: dict[tuple[int, int], dict[str, int]] = {\n'
        + "\n".join(lines)
        + "\n}\n# fmt: on\n"
    )


if __name__ == "__main__":
    main()
