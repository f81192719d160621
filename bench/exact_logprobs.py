r"""Benchmark: what ``--exact_logprobs`` costs through the CLI (issue #34). Runs ``tidal ppo`` in this
process twice with the same flags and seed, first as tidal runs by default, then with ``--exact_logprobs``,
and reads the steps each run logs (``<save_path>/run/metrics.jsonl``).

The workload is ``bench/rl_placement.py``'s local variant (its model folder, prompts, trivial reward and
flags: GRPO, packed micro-batches, gradient checkpointing, ``--zero_stage 2``, one optimizer step a
rollout): a random-init model of ``--config`` (``tiny`` on the CPU), ``--prompts`` x ``--n`` samples of
``--prompt_len`` + up to ``--new_tokens`` tokens, ``--rollouts`` steps; the first step of each run (CUDA
graph capture, first-call costs) is left out. Prints one JSON line:

- ``default`` / ``exact``: the median step time and phase times (``time/*``), every timed step's time, and
  ``rollout/logprob_mismatch`` per step (mean |engine − trainer| log-prob over the response tokens, measured
  by the update's own forward: 0.0 in exact mode), ``max_mismatch``, and the rewards and policy losses per
  step (learning: the runs sample differently, so these agree in distribution, not bit for bit);
- ``ratio``: exact median step time / default median step time (issue #34's target: ≤ 1.5 on the CPU,
  ≤ 1.25 on an H200).

``--profile`` also lists each run's 15 most expensive ops (CPU: self time; CUDA: device time) over the
whole run (all steps), to see where exact mode's time goes.

    python bench/exact_logprobs.py                                   # tiny model on CPU, ~1 minute
    python bench/exact_logprobs.py --prompts 8 --n 4 --prompt_len 32 --new_tokens 64 --micro 16
    python bench/exact_logprobs.py --device cuda --config qwen2.5-0.5b          # issue #34's 0.5B shape
    python bench/exact_logprobs.py --device cuda --config qwen2.5-0.5b --compile
    python bench/exact_logprobs.py --device cuda --config qwen2.5-7b --master_dtype bf16 --rollouts 3

Why ``bench/rl_step.py``-based measurements (this script before issue #34) did not match the CLI: that
step was built from the trainer's parts, not the trainer: no FSDP2 wrapping (``--zero_stage``), its own
micro-batching, ``ignore_eos`` (every response at full length), the policy switched to exact mode after the
default run in the same process; and its default step always ran the old-log-prob forward, which the CLI
skips for an on-policy one-step update (so its default step was ~0.3 s slower than the CLI's and the
ratio looked smaller). Running the CLI itself leaves nothing to match.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_placement  # noqa: E402
from train_step import stub_missing_datasets, versions  # noqa: E402

MODES = {"default": [], "exact": ["--exact_logprobs"]}
PHASES = ("generate", "make_experience", "advantages", "train", "sync_weights")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(rl_placement.CONFIGS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=64, help="samples per micro-batch (update)")
    p.add_argument("--rollouts", type=int, default=4, help="steps per run (the first is not timed)")
    p.add_argument("--compile", action="store_true", help="pass --torch_compile to both runs")
    p.add_argument("--master_dtype", default="fp32", choices=("fp32", "bf16"),
                   help="pass --master_dtype to both runs (bf16: 8 bytes a trained parameter, so that a 7B "
                   "trainer with AdamW and its colocated engine fit on one H200)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="list each run's most expensive ops")
    p.add_argument("--folder", default="/tmp/tidal_exact_logprobs")
    args = p.parse_args(argv)
    if args.config == "tiny" and args.new_tokens == 256:  # rl_placement's CPU shape
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.micro = 4, 4, 16, 16, 8
    if args.rollouts < 2:
        p.error("--rollouts must be at least 2 (the first step is not timed)")
    return args


def run_cli(args, mode: str, model: Path, folder: Path) -> tuple[list[dict], list[dict] | None]:
    """One ``tidal ppo`` run in this process; (its logged steps, its top ops or None)."""
    from tidal.cli.train_ppo import main as ppo_main

    stub_missing_datasets()
    out = folder / mode
    metrics = out / "final" / "run" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a file from an earlier run is not this run's
    extra = ["--colocate_all_models", "--master_dtype", args.master_dtype, *MODES[mode]]
    argv = rl_placement.flags(args, model, folder, out) + extra
    print(f"# {mode}: tidal ppo {' '.join(argv)}", file=sys.stderr, flush=True)
    with profiled(args.profile, args.device) as prof:
        ppo_main(argv)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    return steps, top_ops(prof, args.device) if prof is not None else None


def run_cli_in_child(args, mode: str, model: Path, folder: Path) -> tuple[list[dict], list[dict] | None]:
    """``run_cli`` in a fresh (spawned) process, as a user runs ``tidal ppo``: one run's GPU memory does not
    outlive it (run in this process one after the other, a 7B default run left the exact run too little
    memory for AdamW's states on an H200)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(run_cli, args, mode, model, folder).result()


@contextlib.contextmanager
def profiled(enabled: bool, device: str):
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        yield prof


def top_ops(prof, device: str, count: int = 15) -> list[dict]:
    def total_us(event) -> float:
        return event.device_time_total if device == "cuda" else event.self_cpu_time_total

    events = sorted(prof.key_averages(), key=total_us, reverse=True)[:count]
    return [{"name": e.key[:100], "ms": round(total_us(e) / 1e3, 2), "calls": e.count} for e in events]


def summary(steps: list[dict]) -> dict:
    """Medians over the timed steps (all but the first), and the per-step values."""
    timed = steps[1:]
    mismatch = [s["train/rollout/logprob_mismatch"] for s in steps]
    return {
        "step_s": round(statistics.median(s["train/time/step"] for s in timed), 4),
        "phases_s": {p: round(statistics.median(s[f"train/time/{p}"] for s in timed), 4) for p in PHASES},
        "steps_s": [round(s["train/time/step"], 4) for s in timed],
        "logprob_mismatch": mismatch,
        "max_mismatch": max(mismatch),
        "reward": [round(s["train/reward"], 4) for s in steps],
        "policy_loss": [round(s["train/policy/loss"], 6) for s in steps],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    stub_missing_datasets()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = rl_placement.build_model_in_child(args.config, folder / f"model-{args.config}", args.device)
    rl_placement.write_data(args, folder)
    results = {}
    for mode in MODES:
        steps, ops = run_cli_in_child(args, mode, model, folder)
        results[mode] = summary(steps)
        if ops is not None:
            results[mode]["top_ops"] = ops
    report = {
        "bench": "exact_logprobs", **versions(), "device": args.device, "threads": torch.get_num_threads(),
        "config": args.config, "compile": args.compile, "master_dtype": args.master_dtype,
        "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "micro": args.micro,
        "timed_steps": args.rollouts - 1, **results,
        "ratio": round(results["exact"]["step_s"] / results["default"]["step_s"], 3),
    }  # fmt: skip
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
