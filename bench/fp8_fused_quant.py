"""Benchmark (issue #37): FP8 rollouts' activation quantization, in its own launch or fused into the kernel
that writes the activations, at a decode step's shapes (one GPU; CUDA-graph replay, as the engine decodes).

Per row count (``--rows``: the decode batch) of ``--config``'s shapes, in the same run:

- the RMSNorm before ``qkv_proj`` / ``gate_up_proj`` (residual add included): the bf16 engine's norm
  alone (``norm_ms``), the norm then ``triton_fp8``'s quantization launch (``norm_then_quantize_ms``: what
  an FP8 layer without a fused input runs), and ``triton_norm.add_rms_norm_fp8`` (``norm_fused_ms``);
- SiLU·up before ``down_proj``: the same three (``silu_ms``, ``silu_then_quantize_ms``,
  ``silu_fused_ms``), the fused kernel for each ``--silu_launches`` (BLOCK x num_warps; the first,
  ``auto``, is what the engine runs at that width, ``triton_fused.silu_fp8_launch``);
- whether each fused launch's e4m3 rows and scales equal the separate launch's, bit for bit;
- the sums over a decode step (two norms and one SiLU·up per layer).

Prints one JSON line.

    python bench/fp8_fused_quant.py --config qwen2.5-7b --rows 256 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_matmul import graph_time_ms  # noqa: E402
from rollout import CONFIGS  # noqa: E402
from train_step import versions  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-7b", choices=sorted(CONFIGS))
    p.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument(
        "--silu_launches",
        nargs="+",
        default=["auto", "4096x16", "1024x8", "2048x8"],
        help="BLOCK x num_warps of the fused SiLU·up kernel, each timed (auto: the engine's, by width)",
    )
    return p.parse_args(argv)


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def norm_times(rows: int, hidden: int, repeats: int) -> dict:
    from tidal.rollout.models.triton_norm import add_rms_norm, add_rms_norm_fp8
    from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, res = (torch.randn(2, rows, hidden, device="cuda", generator=gen) * 3).bfloat16()
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()

    def separate():
        out, _ = add_rms_norm(x, weight, 1e-6, res)
        return quantize_rows_triton(out)

    return {
        "norm_ms": graph_time_ms(lambda: add_rms_norm(x, weight, 1e-6, res), repeats),
        "norm_then_quantize_ms": graph_time_ms(separate, repeats),
        "norm_fused_ms": graph_time_ms(lambda: add_rms_norm_fp8(x, weight, 1e-6, res), repeats),
        "norm_bits_equal": same(add_rms_norm_fp8(x, weight, 1e-6, res)[2], separate()),
    }


def silu_times(rows: int, width: int, repeats: int, launches: list[str]) -> dict:
    from tidal.rollout.models import triton_fused
    from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * width, device="cuda", generator=gen) * 3).bfloat16()

    def separate():
        return quantize_rows_triton(triton_fused.silu_and_mul(gate_up))

    result = {
        "silu_ms": graph_time_ms(lambda: triton_fused.silu_and_mul(gate_up), repeats),
        "silu_then_quantize_ms": graph_time_ms(separate, repeats),
        "silu_fused_ms": {},
        "silu_bits_equal": {},
    }
    engine_launch = triton_fused.SILU_FP8_LAUNCH
    try:
        for launch in launches:
            triton_fused.SILU_FP8_LAUNCH = (
                None if launch == "auto" else tuple(int(v) for v in launch.split("x"))
            )
            result["silu_fused_ms"][launch] = graph_time_ms(
                lambda: triton_fused.silu_and_mul_fp8(gate_up), repeats
            )
            result["silu_bits_equal"][launch] = same(triton_fused.silu_and_mul_fp8(gate_up)[1], separate())
    finally:
        triton_fused.SILU_FP8_LAUNCH = engine_launch
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_fused_quant.py: needs a CUDA GPU (Triton kernels)")
    shape = CONFIGS[args.config]
    layers = shape["num_hidden_layers"]
    result: dict = {"bench": "fp8_fused_quant", "config": args.config, **versions(), "rows": {}}
    for rows in args.rows:
        norm = norm_times(rows, shape["hidden_size"], args.repeats)
        silu = silu_times(rows, shape["intermediate_size"], args.repeats, args.silu_launches)
        engine_silu = silu["silu_fused_ms"][args.silu_launches[0]]
        per_step = {
            "bf16_engine_ms": layers * (2 * norm["norm_ms"] + silu["silu_ms"]),
            "separate_ms": layers * (2 * norm["norm_then_quantize_ms"] + silu["silu_then_quantize_ms"]),
            "fused_ms": layers * (2 * norm["norm_fused_ms"] + engine_silu),
            "fused_norm_separate_silu_ms": layers
            * (2 * norm["norm_fused_ms"] + silu["silu_then_quantize_ms"]),
        }
        result["rows"][rows] = {**norm, **silu, "per_step": {k: round(v, 4) for k, v in per_step.items()}}
        print(f"rows {rows}: " + json.dumps(result["rows"][rows]), file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
