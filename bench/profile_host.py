"""Profile: the engine's host bookkeeping per decode step with async scheduling (issue #18).

With async scheduling the host prepares decode step t+1 while the device runs step t, so on a small model
the host's Python bookkeeping, not the device, bounds the step time. This measures that bookkeeping on
the CPU with a tiny model (the device work does not matter here): ``LLMEngine.generate`` of ``--prompts``
prompts x ``--n`` samples (B = prompts x n sequences decoding together), with the host-only methods
wrapped in ``perf_counter`` clocks (``HOST_PHASES`` of ``bench/profile_decode.py``; nothing subtracted):

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

from bench.profile_decode import HOST_PHASES, clocked, phase_ms  # noqa: E402


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
    best = None
    with clocked(engine, HOST_PHASES) as clock:
        steps = count_steps(engine.scheduler)
        for _ in range(args.repeats):
            clock.total.clear()
            steps.clear()
            engine.generate(prompts, params)
            ms = phase_ms(clock, HOST_PHASES, len(steps))
            ms["host_total"] = round(sum(ms.values()), 4)
            if best is None or ms["host_total"] < best["host_total"]:
                best = ms | {"steps": len(steps)}
    return best


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ms = measure(build_engine(args, tmp), args)
    batch = {"batch": args.prompts * args.n, "max_new_tokens": args.max_new_tokens}
    print(json.dumps(batch | ms))


if __name__ == "__main__":
    main()
