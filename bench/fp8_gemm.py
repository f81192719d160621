"""Benchmark (issue #37): the FP8 engine's linear layers at a decode step's shapes, against bf16 cuBLAS in the
same run.

Per weight ``[N, K]`` of a model shape (``exact_matmul.SHAPES``: q/o, k/v, gate/up, down per layer) and per
row count (``--rows``: the decode batch), times three products of the same activations, each inside a
CUDA graph as the engine's decode runs them (``time_ms``):

- ``bf16``: ``torch.nn.functional.linear`` (what the model-dtype engine runs);
- ``fp8``: the engine's path, ``tidal.rollout.quant.linear.fp8_linear`` (per-token activation quantization,
  one Triton launch, then ``torch._scaled_mm`` with row-wise scales; ``use_fast_accum=False``);
- ``fp8_fast_accum``: the same with ``use_fast_accum=True`` (CUTLASS's fast-accumulation schedule: partial
  sums stay in the tensor core's accumulator between K-blocks instead of being promoted to float32 at
  each; what vLLM's Hopper FP8 GEMMs use), and its relative error against the float32 product of the same
  FP8 operands next to ``fp8``'s.

Prints a table to stderr and one JSON line: per shape the three times, and the sums over a decode step
(times the layer count) with the speed-ups over bf16.

    python bench/fp8_gemm.py --config qwen2.5-7b --rows 256 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_matmul import SHAPES, train_launches  # noqa: E402
from train_step import versions  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[256, 32], help="activation rows (decode batch)")
    p.add_argument("--repeats", type=int, default=50)
    return p.parse_args(argv)


def time_ms(fn, repeats: int) -> float:
    """GPU time per call of ``fn``, replayed from one CUDA graph of ``repeats`` calls (the engine decodes
    in CUDA graphs; timed eagerly, the host's launch time of the activation quantization and
    ``torch._scaled_mm`` — ~0.1 ms a call — would hide the kernels' own)."""
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


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def measure(n: int, k: int, rows: int, repeats: int) -> dict[str, float]:
    from tidal.rollout.quant.fp8 import quantize
    from tidal.rollout.quant.linear import _quantize_activations, fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
    q, scales = quantize(w, "channel")  # the engine's weight quantization
    scale_b = scales.view(1, -1)

    def fast() -> torch.Tensor:
        xq, xs = _quantize_activations(x, None)
        return torch._scaled_mm(
            xq, q.t(), scale_a=xs, scale_b=scale_b, out_dtype=x.dtype, use_fast_accum=True
        )

    xq, xs = _quantize_activations(x, None)
    exact = (xq.float() * xs) @ (q.float() * scales).t()  # the FP8 operands' product in float32
    return {
        "bf16_ms": time_ms(lambda: torch.nn.functional.linear(x, w), repeats),
        "fp8_ms": time_ms(lambda: fp8_linear(x, q, scales, "channel"), repeats),
        "fp8_fast_accum_ms": time_ms(fast, repeats),
        "fp8_error": relative_error(fp8_linear(x, q, scales, "channel"), exact),
        "fp8_fast_accum_error": relative_error(fast(), exact),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_gemm.py: needs a CUDA GPU (FP8 GEMMs)")
    shapes = {name: shape for name, shape in train_launches(args.config).items() if name != "lm_head"}
    result: dict = {"bench": "fp8_gemm", "config": args.config, **versions(), "rows": {}}
    for rows in args.rows:
        per_shape, totals = {}, {"bf16_ms": 0.0, "fp8_ms": 0.0, "fp8_fast_accum_ms": 0.0}
        for name, (n, k, count) in shapes.items():
            per_shape[name] = measure(n, k, rows, args.repeats)
            for key in totals:
                totals[key] += per_shape[name][key] * count
            print(
                f"rows {rows} {name:8s} [{n}x{k}] x{count}: " + json.dumps(per_shape[name]), file=sys.stderr
            )
        totals = {key: round(value, 3) for key, value in totals.items()}
        totals["fp8_speedup"] = round(totals["bf16_ms"] / totals["fp8_ms"], 3)
        totals["fp8_fast_accum_speedup"] = round(totals["bf16_ms"] / totals["fp8_fast_accum_ms"], 3)
        result["rows"][rows] = {"per_step": totals, "shapes": per_shape}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
