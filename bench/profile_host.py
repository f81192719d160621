"""Profile: the engine's host bookkeeping per decode step with async scheduling (issue #18).

With async scheduling the host prepares decode step t+1 while the device runs step t, so on a small model
the host's Python bookkeeping, not the device, bounds the step time. This measures that bookkeeping on
the CPU with a tiny model (the device work does not matter here): ``LLMEngine.generate`` of ``--prompts``
prompts x ``--n`` samples (B = prompts x n sequences decoding together), with the host-only methods
wrapped in ``perf_counter`` clocks (``PhaseClock`` from ``bench/profile_decode.py``; nothing subtracted):

- ``schedule``, ``plan_ahead`` + ``release_ahead`` (``plan_ahead``), ``postprocess``: the scheduler;
- ``matches``: whether the step launched ahead is the one scheduled (``Lookahead.matches``);
- ``decode_inputs``: staging a decode step's inputs (``ModelRunner._decode_step``);
- ``sampling_tensors``: the per-row sampling settings (``ModelRunner._sampling_tensors``);
- ``result``: reading a step's sampled ids and log-probs into Python lists (``LaunchedStep.result``).

Prints one JSON line: milliseconds per engine step (prefill included) for each phase and their sum
(``host_total``), from the best of ``--repeats`` runs (the machine is shared: the least disturbed).
One torch thread by default: on a small CPU, torch's worker threads keep spinning after the forward and
compete with the host thread being measured.

    python bench/profile_host.py                       # 32 prompts x 8 samples, 128 new tokens
    python bench/profile_host.py --prompts 4 --n 4     # a small batch
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_decode import PhaseClock  # noqa: E402

PHASES = ("schedule", "plan_ahead", "matches", "postprocess", "decode_inputs", "sampling_tensors", "result")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs (the best is reported)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_engine(args, tmp: str):
    from tidal.rollout import EngineConfig, LLMEngine
    from tidal.testing import build_tiny_model

    path = build_tiny_model(Path(tmp) / "tiny", "qwen2", seed=args.seed)
    config = EngineConfig(
        max_num_seqs=args.prompts * args.n,
        max_model_len=args.prompt_len + args.max_new_tokens + 16,
        device="cpu",
        seed=args.seed,
        async_scheduling=True,
    )
    return LLMEngine(str(path), config)


def wrap_phases(engine, clock: PhaseClock) -> None:
    """Clock the host-only methods (on the instances, or the class where a step makes new instances)."""
    from tidal.rollout import model_runner, scheduler

    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "plan_ahead", "plan_ahead")
    clock.wrap(engine.scheduler, "release_ahead", "plan_ahead")
    clock.wrap(engine.scheduler, "postprocess", "postprocess")
    clock.wrap(engine.runner, "_decode_step", "decode_inputs")
    clock.wrap(engine.runner, "_sampling_tensors", "sampling_tensors")
    clock.wrap(scheduler.Lookahead, "matches", "matches")
    clock.wrap(model_runner.LaunchedStep, "result", "result")


def count_steps(scheduler) -> list:
    """A list that gets one item per engine step (one ``schedule`` call each)."""
    steps = []
    schedule = scheduler.schedule

    def counted():
        steps.append(None)
        return schedule()

    scheduler.schedule = counted
    return steps


def measure(engine, args) -> dict:
    from tidal.rollout import SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(5, 500, (args.prompts, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(
        n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=args.seed
    )
    engine.generate(prompts, params)  # warm-up
    clock = PhaseClock()
    wrap_phases(engine, clock)
    steps = count_steps(engine.scheduler)
    best = None
    for _ in range(args.repeats):
        clock.total.clear()
        steps.clear()
        engine.generate(prompts, params)
        ms = {phase: round(clock.total.get(phase, 0.0) / len(steps) * 1e3, 4) for phase in PHASES}
        ms["host_total"] = round(sum(ms[p] for p in PHASES), 4)
        if best is None or ms["host_total"] < best["host_total"]:
            best = ms | {"steps": len(steps)}
    return best


def main(argv=None) -> None:
    from tidal.rollout import model_runner, scheduler

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    originals = scheduler.Lookahead.matches, model_runner.LaunchedStep.result
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, tmp)
        try:
            ms = measure(engine, args)
        finally:  # the class-level clocks
            scheduler.Lookahead.matches, model_runner.LaunchedStep.result = originals
    batch = {"batch": args.prompts * args.n, "max_new_tokens": args.max_new_tokens}
    print(json.dumps(batch | ms))


if __name__ == "__main__":
    main()
