"""Benchmark: ``--exact_logprobs`` on the GRPO step of ``bench/rl_step.py`` (issue #18's workload), with and
without the mode, in one run on one device.

The same policy (a random-init model of ``--config``, float32 master weights, bf16 autocast on CUDA) runs
``--steps`` timed GRPO steps (after ``--warmup``) first as tidal runs by default, then switched to exact mode
(``batch_invariant.make_exact``; a new engine with ``exact_logprobs``). Every step, in both modes, also runs
the trainer's old-log-prob forward so the gap can be measured; in exact mode the trainer skips that forward,
so the exact step time leaves it out. Prints one JSON line:

- ``without`` / ``with``: max and mean |engine − trainer| log-prob over the response tokens (exact: 0),
  generated tokens/s of the rollout (``new tokens / generate time``), the median phase times and step time;
- ``old_logprob_forward_s``: the default mode's forward that exact mode skips; ``step_cost``: exact step
  time / default step time − 1.

``--profile``: each mode also profiles one rollout (``torch.profiler``) and lists its 15 most expensive
kernels (``top_kernels``: name, total ms, calls), to see where exact mode's decode time goes.

    python bench/exact_logprobs.py                                   # tiny model on CPU, < 1 minute
    python bench/exact_logprobs.py --device cuda --config qwen2.5-0.5b
    python bench/exact_logprobs.py --device cuda --config qwen2.5-0.5b --profile --steps 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_step import PHASES, GRPOStep, parse_args  # noqa: E402
from train_step import reset_memory, stub_missing_datasets, sync, versions  # noqa: E402


def exact_engine(bench: GRPOStep):
    """The rollout engine of ``bench`` rebuilt with ``exact_logprobs`` (its policy already switched)."""
    from tidal.rollout import EngineConfig, LLMEngine

    a = bench.args
    bench.engine.close()
    config = EngineConfig(
        max_num_seqs=a.prompts * a.n, max_model_len=a.prompt_len + a.new_tokens, gpu_memory_utilization=0.3,
        device=str(bench.device), seed=a.seed, exact_logprobs=True,
    )  # fmt: skip
    return LLMEngine(config=config, model=bench.policy)


def run_step(bench: GRPOStep, step: int) -> tuple[dict[str, float], dict[str, float]]:
    """One GRPO step; (seconds per phase, log-prob gap and token counts)."""
    seconds: dict[str, float] = {}

    def timed(phase, fn, *a):
        sync(bench.device)
        start = time.perf_counter()
        out = fn(*a)
        sync(bench.device)
        seconds[phase] = time.perf_counter() - start
        return out

    exp = timed("generate", bench.generate, step)
    exp = timed("reward", bench.reward, exp)
    exp = timed("old_logprobs", bench.old_logprobs, exp)
    mask = exp.action_mask.bool()
    gap = (exp.old_logprobs - exp.rollout_logprobs).abs()[mask]
    exp = timed("advantages", bench.advantages, exp)
    timed("update", bench.update, exp, step)
    timed("sync_weights", bench.sync_weights)
    stats = {"max": float(gap.max()), "mean": float(gap.mean()), "new_tokens": int(mask.sum())}
    return seconds, stats


def top_kernels(bench: GRPOStep, step: int, count: int = 15) -> list[dict]:
    """The ``count`` kernels (CPU: ops) that took the most time in one rollout of ``bench``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = bench.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        bench.generate(step)
        sync(bench.device)

    def total_us(event) -> float:
        return event.device_time_total if cuda else event.self_cpu_time_total

    events = sorted(prof.key_averages(), key=total_us, reverse=True)[:count]
    return [{"name": e.key[:100], "ms": round(total_us(e) / 1e3, 2), "calls": e.count} for e in events]


def measure(bench: GRPOStep, exact: bool, first_step: int) -> dict:
    args = bench.args
    runs = [run_step(bench, first_step + i) for i in range(args.warmup + args.steps)][args.warmup :]
    phases = {p: statistics.median(r[0][p] for r in runs) for p in PHASES}
    skipped = ("old_logprobs",) if exact else ()  # the trainer uses the engine's log-probs instead
    step_s = statistics.median(sum(v for p, v in r[0].items() if p not in skipped) for r in runs)
    return {
        "max_abs_diff": max(r[1]["max"] for r in runs),
        "mean_abs_diff": statistics.mean(r[1]["mean"] for r in runs),
        "generate_tokens_per_s": round(
            statistics.median(r[1]["new_tokens"] / r[0]["generate"] for r in runs)
        ),
        "phases_s": {p: round(v, 4) for p, v in phases.items()},
        "step_s": round(step_s, 4),
    }


def main(argv=None) -> dict:
    from tidal.rollout.batch_invariant import make_exact

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--profile", action="store_true", help="list each mode's most expensive kernels")
    mine, rest = extra.parse_known_args(argv)
    args = parse_args(rest)
    stub_missing_datasets()
    device = torch.device(args.device)
    reset_memory(device)
    bench = GRPOStep(args, device)
    without = measure(bench, exact=False, first_step=0)
    if mine.profile:
        without["top_kernels"] = top_kernels(bench, 0)
    make_exact(bench.policy)  # computes in the engine's dtype (bf16 on CUDA)
    bench.engine = exact_engine(bench)
    with_mode = measure(bench, exact=True, first_step=args.warmup + args.steps)
    if mine.profile:
        with_mode["top_kernels"] = top_kernels(bench, 0)
    report = {
        "bench": "exact_logprobs", **versions(), "device": args.device, "config": args.config,
        "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "micro": args.micro, "without": without, "with": with_mode,
        "old_logprob_forward_s": without["phases_s"]["old_logprobs"],
        "step_cost": round(with_mode["step_s"] / without["step_s"] - 1, 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
    }  # fmt: skip
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
