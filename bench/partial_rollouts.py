r"""Benchmark (issue #35): samples/s of synchronous training, ``--async_train`` and ``--async_train
--partial_rollout_enable`` on a heavy-tailed workload. Runs ``tidal ppo`` in this process once per mode with
the same flags and seed, and reads the steps each run logs (``<save_path>/run/metrics.jsonl``).

The workload is ``bench/rl_placement.py``'s local one (a random-init model of ``--config``, GRPO on its
trivial reward, packed micro-batches, one optimizer step a rollout, the engine on the trainer's device)
with a heavy tail: ``--max_len`` bounds prompt + response and one prompt in ten is ``--new_tokens`` x 7/8
shorter than the others, so its responses may run 8x longer (a random-init model seldom samples its EOS,
so most responses reach their limit). Prints one JSON line: per mode the median step time and phase times
over the timed steps (the first is not timed), samples/s and generated tokens/s, the rewards per step and
(async modes) ``async/stale_token_share``; ``speedup``: samples/s of each async mode / synchronous.

    python bench/partial_rollouts.py                                      # tiny model on CPU, ~1 minute
    python bench/partial_rollouts.py --device cuda --config qwen2.5-0.5b  # issue #35's 0.5B shape
    python bench/partial_rollouts.py --device cuda --config qwen2.5-0.5b --placement separate  # two GPUs
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_placement  # noqa: E402
from train_step import stub_missing_datasets, versions  # noqa: E402

MODES = {
    "sync": [],
    "async": ["--async_train"],
    "async_partial": ["--async_train", "--partial_rollout_enable"],
}
PHASES = ("generate", "make_experience", "train", "sync_weights")
LONG_EVERY = 10  # one prompt in ten gets the long response budget


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(rl_placement.CONFIGS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt_len", type=int, default=64, help="the long-response prompts' length")
    p.add_argument("--new_tokens", type=int, default=1024, help="the long responses' budget (8x the others')")
    p.add_argument("--micro", type=int, default=64, help="samples per micro-batch (scoring and update)")
    p.add_argument("--rollouts", type=int, default=6, help="steps per run (the first is not timed)")
    p.add_argument("--modes", nargs="+", default=None, choices=list(MODES),
                   help="default: every mode the placement runs (separate: no partial rollouts)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="pass --torch_compile to every run")
    p.add_argument("--placement", default="colocated", choices=("colocated", "separate"),
                   help="colocated: the engine in the trainer's process (--colocate_all_models); separate: the "
                        "engine in a process of its own (--vllm_num_engines 1), which does not share the "
                        "trainer's interpreter lock; on CUDA it needs a second GPU")  # fmt: skip
    p.add_argument("--folder", default="/tmp/tidal_partial_rollouts")
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = [m for m in MODES if args.placement == "colocated" or m != "async_partial"]
    elif args.placement == "separate" and "async_partial" in args.modes:
        p.error("--placement separate: partial rollouts need the engine in the trainer's process")
    if args.placement == "separate" and args.device == "cuda" and torch.cuda.device_count() < 2:
        p.error("--placement separate on CUDA: tidal ppo gives the engine a GPU of its own, and this node has "
                f"{torch.cuda.device_count()}")  # fmt: skip
    if args.config == "tiny" and args.new_tokens == 1024:  # a CPU smoke shape
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.micro, args.rollouts = 4, 2, 8, 32, 8, 3
    if args.new_tokens % 8:
        p.error("--new_tokens must be a multiple of 8 (the short responses get an eighth)")
    return args


def write_data(args, folder: Path) -> None:
    """Prompts of digits (one token each): every tenth ``prompt_len`` long, the others 7/8 of
    ``new_tokens`` longer, so under ``--max_len`` their responses get an eighth of the budget."""
    rng = random.Random(0)
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(args.prompts * args.rollouts):
            extra = 0 if i % LONG_EVERY == 0 else args.new_tokens * 7 // 8
            f.write(
                json.dumps(
                    {"prompt": "".join(rng.choice("0123456789") for _ in range(args.prompt_len + extra))}
                )
            )
            f.write("\n")
    (folder / "reward.py").write_text(rl_placement.REWARD)


def mode_flags(args, mode: str, model: Path, folder: Path) -> list[str]:
    argv = rl_placement.flags(args, model, folder, folder / mode)
    # bound prompt + response instead of each (v0.10's --max_len): the short prompts' responses run long
    for flag in ("--prompt_max_len", "--generate_max_len"):
        del argv[argv.index(flag) : argv.index(flag) + 2]
    total = args.prompt_len + args.new_tokens
    placement = ["--colocate_all_models"] if args.placement == "colocated" else ["--vllm_num_engines", "1"]
    return [*argv, "--max_len", str(total), "--prompt_max_len", str(total - 1), *placement,
            "--vllm_generate_batch_size", str(args.prompts), *MODES[mode]]  # fmt: skip


def run_mode(args, mode: str, model: Path, folder: Path) -> dict:
    from tidal.cli.train_ppo import main as ppo_main

    metrics = folder / mode / "final" / "run" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a file from an earlier run is not this run's
    argv = mode_flags(args, mode, model, folder)
    print(f"# {mode}: tidal ppo {' '.join(argv)}", file=sys.stderr, flush=True)
    ppo_main(argv)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = steps[1:]
    step_s = statistics.median(s["train/time/step"] for s in timed)
    samples = args.prompts * args.n
    tokens = statistics.median(s["train/response_length"] for s in timed) * samples
    out = {
        "step_s": round(step_s, 4),
        "phases_s": {p: round(statistics.median(s[f"train/time/{p}"] for s in timed), 4) for p in PHASES},
        "samples_per_s": round(samples / step_s, 3),
        "generated_tokens_per_s": round(tokens / step_s, 1),
        "reward": [round(s["train/reward"], 4) for s in steps],
    }
    if "train/async/stale_token_share" in steps[0]:
        out["stale_token_share"] = [round(s["train/async/stale_token_share"], 4) for s in steps]
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    stub_missing_datasets()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = rl_placement.build_model_in_child(args.config, folder / f"model-{args.config}", args.device)
    write_data(args, folder)
    results = {mode: run_mode(args, mode, model, folder) for mode in args.modes}
    report = {
        "bench": "partial_rollouts", **versions(), "device": args.device, "threads": torch.get_num_threads(),
        "config": args.config, "placement": args.placement, "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "long_every": LONG_EVERY, "timed_steps": args.rollouts - 1, **results,
    }  # fmt: skip
    if "sync" in results:
        base = results["sync"]["samples_per_s"]
        report["speedup"] = {
            m: round(r["samples_per_s"] / base, 3) for m, r in results.items() if m != "sync"
        }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
