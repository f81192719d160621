"""Benchmark (issue #37): the FP8 engine's linear layers at a decode step's shapes, against bf16 cuBLAS in the
same run.

Per weight ``[N, K]`` the engine launches at decode (``exact_matmul.decode_launches``: q/k/v and gate/up
packed, as the engine runs them; the LM head stays bf16 in FP8 mode and is left out) and per row count
(``--rows``: the decode batch), times the same activations through, each inside a CUDA graph as the
engine's decode runs them (``time_ms``), cycling through copies of the weights that together exceed the
L2 eight times, so that every call reads its weights from HBM as a decode step does (``cold_time_ms``):

- ``bf16``: ``torch.nn.functional.linear`` (what the model-dtype engine runs);
- ``scaled_mm``: per-token activation quantization (one Triton launch) then ``torch._scaled_mm`` with
  row-wise scales and fast accumulation (the engine's path before the Triton GEMM; still its path above
  ``MAX_ROWS`` tokens);
- ``triton``: the same quantization then ``triton_fp8_gemm.fp8_gemm`` with the launch the engine takes
  (``fp8_gemm_config.gemm_config``: the tuned table's, else ``default_config``'s), and ``engine``: whichever of the two
  ``fp8_linear`` runs at that shape.

Relative errors against the float32 product of the same FP8 operands are reported for both FP8 GEMMs.
``--search`` first tries tiles per shape and row bucket for ``--deadline_s`` seconds and keeps the fastest
launch, or ``None`` where ``torch._scaled_mm`` stays faster; ``--write`` merges them into
``tidal/rollout/quant/fp8_gemm_tuned.py``. Prints a table to stderr and one JSON line: per shape the
times, and the sums over a decode step (times the layer count) with the speed-ups over bf16.

    python bench/fp8_gemm.py --config qwen2.5-7b --rows 256 32
    python bench/fp8_gemm.py --config qwen2.5-7b --rows 256 64 16 --search --deadline_s 200 --write
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_matmul import SHAPES, decode_launches  # noqa: E402
from exact_matmul import graph_time_ms as time_ms  # noqa: E402
from train_step import versions  # noqa: E402

SPLITS = (1, 2, 3, 4, 5, 6, 7, 8)  # K range counts ``--search`` tries (``--splits``)
SHARED_BYTES = 220 * 1024  # the H200's 227 KB a block, less the kernel's own use: deeper stages cannot launch
TABLE = Path(__file__).resolve().parents[1] / "tidal" / "rollout" / "quant" / "fp8_gemm_tuned.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[256, 32], help="activation rows (decode batch)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--search", action="store_true", help="search tiles per shape and row bucket first")
    p.add_argument("--deadline_s", type=float, default=200.0, help="--search stops after this long")
    p.add_argument("--write", action="store_true", help="merge the search's launches into fp8_gemm_tuned.py")
    p.add_argument(
        "--jobs", type=int, default=1, help="--search compiles its launches in this many processes"
    )
    p.add_argument(
        "--shapes", nargs="+", choices=["qkv", "o", "gate_up", "down"], help="search and time these only"
    )
    p.add_argument(
        "--splits", type=int, nargs="+", default=list(SPLITS), help="--search tries K cut this many times"
    )
    return p.parse_args(argv)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def operands(n: int, k: int, rows: int):
    from tidal.rollout.quant.fp8 import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
    q, scales = quantize(w, "channel")  # the engine's weight quantization
    return x, w, q, scales


COLD_BYTES = 400 * 2**20  # weight copies a timing rotates over: 8x the H200's 50 MB L2


def weight_copies(q: torch.Tensor, scales: torch.Tensor, w: torch.Tensor | None = None) -> list[tuple]:
    """Copies of one layer's weights, (bf16 or None, e4m3, scales), that together exceed the L2 several
    times: a decode step reads each layer's weights once, from HBM, so a timing that replays one weight
    would read a small one (qkv, o) from L2 instead. The bf16 weight is copied only when given (the
    search times FP8 launches alone)."""
    count = max(2, -(-COLD_BYTES // q.numel()))
    return [(w, q, scales)] + [
        (None if w is None else w.clone(), q.clone(), scales.clone()) for _ in range(count - 1)
    ]


def cold_time_ms(call, copies: list[tuple], repeats: int) -> float:
    """``time_ms`` of ``call(w, q, scales)`` cycling through ``copies`` (at least once through all)."""
    turns = itertools.cycle(copies)
    return time_ms(lambda: call(*next(turns)), max(repeats, len(copies)))


def scaled_mm(x, q, scales):
    from tidal.rollout.quant.gemm import _quantize_activations

    xq, xs = _quantize_activations(x, None)
    return torch._scaled_mm(  # fast accumulation, as ``fp8_linear`` runs it
        xq, q.t(), scale_a=xs, scale_b=scales.view(1, -1), out_dtype=x.dtype, use_fast_accum=True
    )


def triton(x, q, scales, config):
    from tidal.rollout.quant.gemm import _quantize_activations
    from tidal.rollout.quant.triton_fp8_gemm import fp8_gemm

    xq, xs = _quantize_activations(x, None)
    return fp8_gemm(xq, xs, q, scales, config, None, x.dtype)


def candidates(rows: int, n: int, k: int, splits=SPLITS):
    """Tiles tried by ``--search``: TMA loads first (Hopper), then pointer loads; row tiles near the token
    count (256 rows: also 64-row and 256-row tiles), 64-256 columns, K cut ``splits`` times (each range at
    least 4 K steps; any count, not only powers of two: with a few dozen output tiles, 3, 5, 6 or 7 ranges
    may fill 132 SMs a whole number of times where 2, 4 and 8 leave a part-empty wave), 128-column K steps
    pipelined 3, 4 or 6 deep, or 256-column K steps 3 or 4 deep where the stages fit the shared memory.
    Deeper pipelines and 64-row tiles were first seen winning at 256 rows in session 21 (7B ``down``:
    44.0 µs against 47.1 for the table's launch; ``o``: 11.9 against 12.8)."""
    from tidal.rollout.quant.fp8_gemm_config import Fp8GemmConfig, row_bucket

    bucket = row_bucket(rows)
    row_tiles = {min(128, max(16, bucket // 2)), min(128, bucket)}
    if bucket >= 256:
        row_tiles |= {64, 256}
    steps = [(128, 3), (128, 4), (128, 6), (256, 3), (256, 4)]
    for tma in (1, 0) if torch.cuda.get_device_capability()[0] >= 9 else (0,):
        for block_m in sorted(row_tiles):
            for block_n in (64, 128, 256):
                if block_m * block_n > 256 * 128:  # the accumulator would not fit in registers
                    continue
                for split_k in splits:
                    if split_k > 1 and -(-k // 128) < 4 * split_k:
                        continue
                    for block_k, num_stages in steps:
                        if (block_m + block_n) * block_k * num_stages > SHARED_BYTES:
                            continue
                        warps = 8 if block_m * block_n >= 128 * 128 else 4
                        yield Fp8GemmConfig(block_m, block_n, block_k, split_k, warps, num_stages, tma)


_OPERANDS: dict = {}  # a precompile worker's operands per (n, k, rows), made once


def _compile_one(task) -> None:
    """A worker of ``precompile``: run one launch once, so that Triton's disk cache holds its binary."""
    n, k, rows, config = task
    if (n, k, rows) not in _OPERANDS:
        _OPERANDS[n, k, rows] = operands(n, k, rows)
    x, _, q, scales = _OPERANDS[n, k, rows]
    try:
        triton(x, q, scales, config)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a tile the GPU cannot hold: search skips it too
        pass


def precompile(n: int, k: int, rows: int, jobs: int, splits=SPLITS) -> None:
    """Compile every candidate launch in ``jobs`` processes first (each a CUDA context of its own): Triton's
    compiler, ~1 s a launch, is most of a search's time; the timing loop then reads the disk cache."""
    import multiprocessing

    tasks = [(n, k, rows, config) for config in candidates(rows, n, k, splits)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile_one, tasks, chunksize=1)


def search(n: int, k: int, rows: int, repeats: int, deadline: float, jobs: int = 1, splits=SPLITS):
    """The fastest launch at this shape (None: ``torch._scaled_mm`` is faster), its time, and whether every
    candidate was tried before the deadline. The launch the engine takes now is the bar to beat, so a
    search cut short never makes a shape slower."""
    from tidal.accel import sm_count
    from tidal.rollout.quant.fp8_gemm_config import gemm_config

    if jobs > 1:
        precompile(n, k, rows, jobs, splits)
    x, _, q, scales = operands(n, k, rows)
    copies = weight_copies(q, scales)
    best_ms, best = cold_time_ms(lambda _, q, s: scaled_mm(x, q, s), copies, repeats), None
    if (current := gemm_config(rows, n, k, sm_count(x.device), False)) is not None:
        current_ms = cold_time_ms(lambda _, q, s: triton(x, q, s, current), copies, repeats)
        if current_ms < best_ms:
            best_ms, best = current_ms, current
    for config in candidates(rows, n, k, splits):
        if time.time() > deadline:
            return best, best_ms, False
        try:
            ms = cold_time_ms(lambda _, q, s, c=config: triton(x, q, s, c), copies, repeats)
        except Exception as err:  # a tile the GPU cannot hold (shared memory): skip it
            print(f"  {config}: {type(err).__name__}", file=sys.stderr)
            continue
        if ms < best_ms * 0.98:  # a clear win only
            best_ms, best = ms, config
    return best, best_ms, True


def measure(n: int, k: int, rows: int, repeats: int) -> dict[str, float]:
    from tidal.accel import sm_count
    from tidal.rollout.quant.fp8_gemm_config import default_config, gemm_config
    from tidal.rollout.quant.gemm import _quantize_activations, fp8_linear

    x, w, q, scales = operands(n, k, rows)
    copies = weight_copies(q, scales, w)
    config = gemm_config(rows, n, k, sm_count(x.device), False)
    launch = config or default_config(rows, n, k, sm_count(x.device))
    xq, xs = _quantize_activations(x, None)
    exact = (xq.float() * xs) @ (q.float() * scales).t()  # the FP8 operands' product in float32
    return {
        "bf16_ms": cold_time_ms(lambda w, _, __: torch.nn.functional.linear(x, w), copies, repeats),
        "scaled_mm_ms": cold_time_ms(lambda _, q, s: scaled_mm(x, q, s), copies, repeats),
        "triton_ms": cold_time_ms(lambda _, q, s: triton(x, q, s, launch), copies, repeats),
        "engine_ms": cold_time_ms(lambda _, q, s: fp8_linear(x, q, s, "channel"), copies, repeats),
        "engine_runs": "triton" if config else "scaled_mm",
        "launch": launch.fields(),
        "scaled_mm_error": relative_error(scaled_mm(x, q, scales), exact),
        "triton_error": relative_error(triton(x, q, scales, launch), exact),
    }


def write_table(found: dict, info: str) -> None:
    from tidal.rollout.quant import fp8_gemm_tuned

    table = {shape: dict(buckets) for shape, buckets in fp8_gemm_tuned.TUNED.items()}
    for (n, k, bucket), config in found.items():
        table.setdefault((n, k), {})[bucket] = None if config is None else config.fields()
    text = TABLE.read_text()
    head = (
        text[: text.index("Written by")]
        + f"Written by ``bench/fp8_gemm.py --search --write`` (last: {info}).\n"
    )
    body = "\n".join(f"    {key}: {value!r}," for key, value in sorted(table.items()))
    TABLE.write_text(
        f'{head}"""\n\n# (N, K) -> {{token bucket: Fp8GemmConfig fields, or None for torch._scaled_mm}}\n'
        f"# fmt: off\nTUNED: dict[tuple[int, int], dict[int, dict[str, int] | None]] = {{\n{body}\n}}\n# fmt: on\n"
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_gemm.py: needs a CUDA GPU (FP8 GEMMs)")
    from tidal.rollout.quant.fp8_gemm_config import row_bucket

    shapes = {name: s[:3] for name, s in decode_launches(args.config).items() if name != "lm_head"}
    shapes = {name: s for name, s in shapes.items() if name in (args.shapes or shapes)}
    result: dict = {"bench": "fp8_gemm", "config": args.config, **versions(), "rows": {}}
    if args.search:
        deadline, found = time.time() + args.deadline_s, {}
        for rows in args.rows:
            for name, (n, k, _) in shapes.items():
                config, ms, complete = search(
                    n, k, rows, args.repeats, deadline, args.jobs, tuple(args.splits)
                )
                found[n, k, row_bucket(rows)] = config
                done = "" if complete else " (deadline: not every tile tried)"
                print(f"search rows {rows} {name} [{n}x{k}]: {config} {ms:.4f} ms{done}", file=sys.stderr)
        if args.write:
            when = datetime.date.today().isoformat()
            write_table(
                found, f"{args.config}, {torch.cuda.get_device_name()}, torch {torch.__version__}, {when}"
            )
            import importlib

            from tidal.rollout.quant import fp8_gemm_tuned

            importlib.reload(fp8_gemm_tuned)
        result["search"] = {f"{n}x{k}@{b}": c and c.fields() for (n, k, b), c in found.items()}
    for rows in args.rows:
        per_shape = {}
        totals = dict.fromkeys(("bf16_ms", "scaled_mm_ms", "triton_ms", "engine_ms"), 0.0)
        for name, (n, k, count) in shapes.items():
            per_shape[name] = measure(n, k, rows, args.repeats)
            for key in totals:
                totals[key] += per_shape[name][key] * count
            print(
                f"rows {rows} {name:8s} [{n}x{k}] x{count}: " + json.dumps(per_shape[name]), file=sys.stderr
            )
        totals = {key: round(value, 3) for key, value in totals.items()}
        for key in ("scaled_mm", "triton", "engine"):
            totals[f"{key}_speedup"] = round(totals["bf16_ms"] / totals[f"{key}_ms"], 3)
        result["rows"][rows] = {"per_step": totals, "shapes": per_shape}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
