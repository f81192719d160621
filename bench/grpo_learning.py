"""Benchmark: GRPO learns as well on CUDA as on the CPU (same seeds, same SFT starting point).

A sampler that does not draw from softmax(logits / T) still trains, just worse: it explores less and
optimises a biased estimate. This runs the demo's task (noisy-label SFT on addition, then GRPO with a
rule reward, ``tidal.cli.demo``) for each seed: the SFT model is trained once on the CPU, then GRPO runs
from it on each device (child processes; ``CUDA_VISIBLE_DEVICES=`` hides the GPU for the CPU run), and
the held-out accuracy (greedy and sampled at T=1, measured by the CPU engine) is compared.

Prints one JSON line: per device, the accuracies per seed and their means.

    python bench/grpo_learning.py --seeds 0 1 2 --rollouts 48   # needs a GPU for the cuda column
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tidal.cli.demo import Demo, DemoConfig
from tidal.testing import build_tiny_model


def _demo(root: Path, seed: int, rollouts: int) -> Demo:
    return Demo(DemoConfig(output_dir=str(root), seed=seed, rl_rollouts=rollouts, skip_preference=True))


def stage(args) -> None:
    """One stage in this process (on whatever device it sees): ``sft`` or ``rl``; prints a JSON line."""
    root = Path(args.root)
    if args.stage == "sft":
        base = build_tiny_model(root / "base", "qwen2", seed=args.seed)
        print(json.dumps({"sft": str(_demo(root, args.seed, args.rollouts).sft(base))}))
        return
    demo = _demo(root / f"rl_{args.device}", args.seed, args.rollouts)
    model = demo.rl(root / "sft_model")
    print(json.dumps(demo.accuracy(model)))


def _child(argv: list[str], cpu_only: bool) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if cpu_only else dict(os.environ)
    out = subprocess.run(
        [sys.executable, __file__, *argv], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rollouts", type=int, default=48, help="GRPO steps (32 prompts x 8 samples)")
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"], choices=["cpu", "cuda"])
    parser.add_argument("--root", default="./runs/grpo_learning")
    parser.add_argument("--stage", choices=["sft", "rl"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        return stage(args)
    results: dict[str, dict] = {d: {"greedy": [], "sampled": []} for d in args.devices}
    common = ["--rollouts", str(args.rollouts)]
    for seed in args.seeds:
        root = str(Path(args.root) / f"seed{seed}")
        _child(["--stage", "sft", "--seed", str(seed), "--root", root, *common], cpu_only=True)
        for device in args.devices:
            acc = _child(
                ["--stage", "rl", "--seed", str(seed), "--root", root, "--device", device, *common],
                cpu_only=device == "cpu",
            )
            for key in ("greedy", "sampled"):
                results[device][key].append(round(acc[key], 4))
            print(f"seed {seed} {device}: {acc}", file=sys.stderr, flush=True)
    for r in results.values():
        r.update({f"mean_{k}": round(statistics.mean(r[k]), 4) for k in ("greedy", "sampled")})
    print(json.dumps({"bench": "grpo_learning", "seeds": args.seeds, "rollouts": args.rollouts, **results}))


if __name__ == "__main__":
    main()
