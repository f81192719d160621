"""Benchmark (issue #31): the fused MoE kernels' tile sizes at decode shapes, against today's ``tile_configs``.

``triton_moe.tile_configs`` picks the launches (rows per block, output columns, K step, warps, stages) of
the two expert GEMMs from the pairs an expert gets on average (its ``DECODE_TILES`` came from this bench;
before them one untuned launch served both). Per
MoE shape (``--shapes``: gpt-oss-20b's experts with biases and the clamped SwiGLU, Qwen3.5-35B-A3B's,
Qwen3-30B-A3B's) and per ``--tokens`` (decode batch), in the model dtype (bf16) and with e4m3 experts
(``--fp8``: FP8 rollouts' per-channel scales), this times the two launches of ``fused_expert_forward``
apart, each replayed from a CUDA graph (``fp8_gemm.time_ms``), over random balanced routing. The e4m3 rows
time what the engine runs on an FP8-capable GPU: W8A8, each GEMM launch with the per-row e4m3 quantization
of its input (``quantize_rows_triton``, one launch) that precedes it; FP8 ``tl.dot`` wants K steps of 32
or more, as every candidate here is:

1. per rows-per-block near the pairs an expert gets (``block_m_candidates``), every (columns, K step)
   with 4 warps and 3 stages;
2. around the best of each kernel: warps x stages.

The gated (gate/up) and the down launch are scored apart (they share only the rows per block, which sets
the padding of the alignment), so the best pair is the best rows-per-block with each kernel's best launch.
Reports per shape: today's launch, the best one, their times, and the share of the bandwidth roofline
(expert weights of the routed experts read once) each reaches. Prints a table to stderr and one JSON line.

    PYTHONPATH=$PWD python3 bench/moe_tiles.py --fp8      # one H200: ~5 minutes (compiles)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_matmul import graph_time_ms as time_ms  # noqa: E402
from train_step import versions  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s, datasheet


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int
    gpt_oss: bool = False  # biases and the clamped SwiGLU


SHAPES = {
    "gpt-oss-20b": Shape(32, 4, 2880, 2880, gpt_oss=True),
    "qwen3.5-35b-a3b": Shape(256, 8, 2048, 512),
    "qwen3-30b-a3b": Shape(128, 8, 2048, 768),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[256])
    p.add_argument("--fp8", action="store_true", help="also time e4m3 experts (per-channel scales)")
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args(argv)


class Problem:
    """One shape's random experts, routing and alignment buffers on the GPU."""

    def __init__(self, shape: Shape, tokens: int, fp8: bool):
        from tidal.rollout.kernels import triton_moe as tm
        from tidal.rollout.quant.fp8 import quantize

        gen = torch.Generator(device="cuda").manual_seed(0)
        e, h, i = shape.experts, shape.hidden, shape.inter
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        self.shape, self.tokens, self.fp8 = shape, tokens, fp8
        self.x = torch.randn(tokens, h, generator=gen, **bf16)
        self.gate_up = torch.randn(e, 2 * i, h, generator=gen, **bf16) / h**0.5
        self.down = torch.randn(e, h, i, generator=gen, **bf16) / i**0.5
        self.scales = None
        if fp8:
            q_gu, s_gu = quantize(self.gate_up.view(-1, h), "channel")
            q_d, s_d = quantize(self.down.view(-1, i), "channel")
            self.gate_up, self.down = q_gu.view(e, 2 * i, h), q_d.view(e, h, i)
            self.scales = (s_gu.view(e, 2 * i), s_d.view(e, h))
        self.biases = None
        self.swiglu = None
        if shape.gpt_oss:
            self.biases = (
                torch.randn(e, 2 * i, generator=gen, **bf16),
                torch.randn(e, h, generator=gen, **bf16),
            )
            self.swiglu = tm.ClampedSwiGLU(alpha=1.702, limit=7.0)
        logits = torch.randn(tokens, e, device="cuda", generator=gen)
        weights, self.ids = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)
        self.route = weights.reshape(-1).to(torch.bfloat16).contiguous()
        self.routed = int(torch.unique(self.ids).numel())

    def weight_bytes(self) -> int:
        """Bytes of the routed experts' weights, each read once (the decode roofline's traffic)."""
        per = 3 * self.shape.hidden * self.shape.inter * (1 if self.fp8 else 2)
        return self.routed * per

    def launch(self, gated: bool, cfg, aligned, inter, out) -> None:
        """One GEMM launch as ``fused_expert_forward`` runs it; e4m3 experts: W8A8, its input's per-row
        quantization first (the engine's path, ``quantize_activations``)."""
        from tidal.rollout.kernels import triton_moe as tm
        from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

        s_gu, s_d = self.scales or (None, None)
        b_gu, b_d = self.biases or (None, None)
        a = self.x if gated else inter
        a, a_scale = quantize_rows_triton(a) if self.fp8 else (a, None)
        if gated:
            tm._launch(a, self.gate_up, inter, self.route, aligned, self.shape.top_k, True, cfg, s_gu, b_gu,
                       self.swiglu, a_scale)  # fmt: skip
        else:
            tm._launch(
                a, self.down, out, self.route, aligned, self.shape.top_k, False, cfg, s_d, b_d, None, a_scale
            )

    def time(self, gated: bool, cfg, repeats: int) -> float:
        from triton.runtime.errors import OutOfResources

        from tidal.rollout.kernels import triton_moe as tm

        aligned = tm.align_pairs(self.ids, self.shape.experts, cfg.block_m)
        inter = self.x.new_zeros(aligned.sorted_pairs.numel(), self.shape.inter)
        out = self.x.new_empty(self.ids.numel(), self.shape.hidden)
        try:
            return time_ms(lambda: self.launch(gated, cfg, aligned, inter, out), repeats)
        except OutOfResources as exc:  # a launch over the shared memory or registers is skipped
            print(f"  skip {cfg}: {str(exc)[:120]}", file=sys.stderr)
            return float("inf")


def block_m_candidates(pairs: int, experts: int) -> list[int]:
    """Rows per block worth trying: the first power of two (16 at least, ``tl.dot``'s smallest M) that
    holds an expert's average pairs, and twice it (routing is uneven: an expert over its block is read
    twice); at a few pairs an expert, 16 alone."""
    rows = pairs / experts
    first = 16
    while first < rows and first < 128:
        first *= 2
    return [16] if rows <= 8 else [first, 2 * first]


def search(problem: Problem, gated: bool, block_m: int, repeats: int):
    """Best launch of one kernel at this rows-per-block: (ms, TileConfig)."""
    from tidal.rollout.kernels.triton_moe import TileConfig

    first = [
        TileConfig(block_m, n, k, num_warps=4, num_stages=3)
        for n, k in itertools.product((32, 64, 128), (64, 128, 256))
    ]
    scored = sorted(((problem.time(gated, c, repeats), c) for c in first), key=lambda pair: pair[0])
    best = scored[0][1]
    second = [
        replace(best, num_warps=w, num_stages=s)
        for w, s in itertools.product((4, 8), (2, 3, 4))
        if (w, s) != (best.num_warps, best.num_stages)
    ]
    scored += [(problem.time(gated, c, repeats), c) for c in second]
    return min(scored, key=lambda pair: pair[0])


def measure(name: str, shape: Shape, tokens: int, fp8: bool, repeats: int) -> dict:
    from tidal.rollout.kernels.triton_moe import tile_configs

    problem = Problem(shape, tokens, fp8)
    today = tile_configs(problem.ids.numel(), shape.experts, fp8)
    today_ms = problem.time(True, today[0], repeats) + problem.time(False, today[1], repeats)
    best = None
    for block_m in block_m_candidates(problem.ids.numel(), shape.experts):
        gated_ms, gated_cfg = search(problem, True, block_m, repeats)
        down_ms, down_cfg = search(problem, False, block_m, repeats)
        candidate = (gated_ms + down_ms, gated_ms, down_ms, gated_cfg, down_cfg)
        best = candidate if best is None or candidate[0] < best[0] else best
    total, gated_ms, down_ms, gated_cfg, down_cfg = best
    roofline_ms = problem.weight_bytes() / H200_BANDWIDTH * 1e3
    row = dict(
        shape=name, tokens=tokens, weights="e4m3" if fp8 else "bf16", routed_experts=problem.routed,
        today_gated=asdict(today[0]), today_down=asdict(today[1]), today_ms=round(today_ms, 4), today_roofline=round(roofline_ms / today_ms, 3),
        best_ms=round(total, 4), best_roofline=round(roofline_ms / total, 3), speedup=round(today_ms / total, 3),
        best_gated=asdict(gated_cfg), best_gated_ms=round(gated_ms, 4),
        best_down=asdict(down_cfg), best_down_ms=round(down_ms, 4),
    )  # fmt: skip
    print(
        f"{name:16s} T={tokens:4d} {row['weights']:5s} today {today_ms * 1e3:7.1f} us ({row['today_roofline']:.2f})"
        f"  best {total * 1e3:7.1f} us ({row['best_roofline']:.2f})  gated {gated_cfg}  down {down_cfg}",
        file=sys.stderr,
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_tiles.py: needs a CUDA GPU (it times Triton launches)")
    rows = []
    for name in args.shapes:
        for tokens in args.tokens:
            for fp8 in (False, True) if args.fp8 else (False,):
                rows.append(measure(name, SHAPES[name], tokens, fp8, args.repeats))
    print(json.dumps(dict(bench="moe_tiles", device=torch.cuda.get_device_name(), **versions(), rows=rows)))


if __name__ == "__main__":
    main()
