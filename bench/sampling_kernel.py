"""Benchmark: the fused sampling kernels (``tidal/rollout/kernels/triton_sampling.py``) on one CUDA device.

Times ``fused_sample`` at a 152k vocabulary (Qwen2.5's 151,936), bf16 logits, for each ``--rows`` and
each ``--temperatures`` (every row at that temperature; 1.0 is the RL default, where the split programs
skip the division; 0 is all greedy): the one-program-per-row kernel (``chunks=1``, the kernel before the
split) against the split-vocabulary kernels at their default settings. Each variant is captured
``--calls`` times in a CUDA graph (as decode runs it) and the graph replayed ``--reps`` times between CUDA
events, so the time is the GPU's per call without host launch cost. ``--sweep`` also times other (lanes,
warps, programs per SM) settings of the split kernels. Every variant's tokens are checked against the
one-program kernel's.

Prints one JSON line: ``{"vocab": .., "runs": [{"rows": .., "temperature": .., "one_program_ms": ..,
"split_ms": .., "chunks": .., "speedup": .., "sweep": {"<lanes>x<warps>@<programs per SM>": {"ms": ..,
"chunks": ..}, ...}}, ...], "tokens_equal": true, "device": .., "sms": .., "torch": .., "triton": ..}``.

    python bench/sampling_kernel.py
    python bench/sampling_kernel.py --rows 1 64 256 1024 --temperatures 1.0 0.7 0 --sweep
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import triton  # noqa: E402

from tidal.accel import sm_count  # noqa: E402
from tidal.rollout.kernels import triton_sampling as ts  # noqa: E402

SWEEP = [(512, 4, 8), (512, 4, 16), (1024, 4, 8), (1024, 8, 8), (1024, 8, 4), (2048, 8, 4), (256, 2, 16)]


def inputs(rows: int, vocab: int, temperature: float):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).bfloat16()
    temps = torch.full((rows,), temperature, device="cuda")
    seeds = torch.randint(0, 2**32, (rows,), device="cuda", generator=gen)
    positions = torch.randint(0, 4096, (rows,), device="cuda", generator=gen)
    return logits, temps, seeds, positions


def time_graph(fn, calls: int, reps: int) -> tuple[float, torch.Tensor]:
    """GPU ms per call of ``fn`` replayed from a CUDA graph of ``calls`` calls; and its last tokens."""
    fn()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                tokens, _ = fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * calls), tokens.clone()


def with_settings(block: int, warps: int, per_sm: int):
    """Set the split kernels' module settings; returns the previous ones."""
    previous = (ts.SPLIT_BLOCK, ts.SPLIT_WARPS, ts.PROGRAMS_PER_SM)
    ts.SPLIT_BLOCK, ts.SPLIT_WARPS, ts.PROGRAMS_PER_SM = block, warps, per_sm
    return previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()

    sms = sm_count(torch.device("cuda"))
    runs, all_equal = [], True
    for rows in args.rows:
        for temperature in args.temperatures:
            logits, temps, seeds, positions = inputs(rows, args.vocab, temperature)
            if temperature == 0:
                temps = seeds = positions = None  # the greedy kernels, as the sampler calls them

            def sample(chunks=None, logits=logits, temps=temps, seeds=seeds, positions=positions):
                return ts.fused_sample(logits, temps, seeds, positions, chunks=chunks)

            one_ms, want = time_graph(lambda: sample(chunks=1), args.calls, args.reps)
            split_ms, tokens = time_graph(sample, args.calls, args.reps)
            all_equal &= torch.equal(tokens, want)
            run = {
                "rows": rows,
                "temperature": temperature,
                "one_program_ms": round(one_ms, 4),
                "split_ms": round(split_ms, 4),
                "chunks": ts.split_chunks(rows, args.vocab, sms, ts.SPLIT_BLOCK),
                "speedup": round(one_ms / split_ms, 2),
            }
            if args.sweep:
                run["sweep"] = {}
                for block, warps, per_sm in SWEEP:
                    previous = with_settings(block, warps, per_sm)
                    try:
                        ms, tokens = time_graph(sample, args.calls, args.reps)
                        chunks = ts.split_chunks(rows, args.vocab, sms, block)
                    finally:
                        with_settings(*previous)
                    all_equal &= torch.equal(tokens, want)
                    run["sweep"][f"{block}x{warps}@{per_sm}"] = {"ms": round(ms, 4), "chunks": chunks}
            runs.append(run)
    print(
        json.dumps(
            {
                "vocab": args.vocab,
                "runs": runs,
                "tokens_equal": all_equal,
                "device": torch.cuda.get_device_name(),
                "sms": sms,
                "torch": torch.__version__,
                "triton": triton.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
