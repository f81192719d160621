"""Benchmark: a short SFT + GRPO run learns on a synthetic task as well with Qwen3.5 as with Qwen2 (issue #31).

Two tiny random-init models of about the same size (``tidal.testing``'s tiny ``qwen3_5_text``: three Gated
DeltaNet layers and one gated attention layer, 1.72M parameters; tiny ``qwen2``: four attention layers,
1.67M) go through the same run, per seed, on the CPU: ``tidal sft`` on the demo's noisy-label addition
task (``tidal.testing.tasks.AdditionTask``, ``tidal.cli.demo``'s settings without ``--packing_samples``,
which would run Qwen3.5's linear-attention layers across sample boundaries), then GRPO through ``tidal
ppo`` (``Demo.rl``: 32 prompts x 8 samples a rollout, rule reward). Held-out accuracy (greedy, and
sampled at T=1 with 4 samples) is measured by tidal's engine before GRPO (after SFT) and after it.

Prints one JSON line: per family, parameters, the accuracies per seed and their means, seconds per run.
One torch thread by default: on a shared 2-core machine more threads oversubscribe the cores and the
run slows down ~15x.

    python bench/family_learning.py                          # seeds 0 1: ~6 minutes on 2 shared cores
    python bench/family_learning.py --seeds 0 1 2 --rollouts 40 --train_samples 4096 --sft_epochs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

FAMILIES = ("qwen2", "qwen3_5_text")
KEYS = ("greedy", "sampled")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--train_samples", type=int, default=2048, help="SFT samples (the demo: 4096)")
    p.add_argument("--sft_epochs", type=int, default=3)
    p.add_argument("--rollouts", type=int, default=16, help="GRPO steps (32 prompts x 8 samples each)")
    p.add_argument("--eval_samples", type=int, default=200, help="held-out prompts")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: a shared machine)")
    p.add_argument("--root", default="./runs/family_learning")
    return p.parse_args(argv)


def sft(demo, base: Path) -> Path:
    """``tidal sft`` with the demo's settings, rows unpacked (both families alike)."""
    from tidal.cli.train_sft import parse_run
    from tidal.trainers.sft import run_sft

    c, out = demo.cfg, demo.root / "sft_model"
    train = demo.task.write_jsonl(demo.data / "sft.jsonl", c.train_samples, "train", c.sft_wrong_fraction)
    run_sft(parse_run([
        "--pretrain", str(base), "--dataset", str(train), "--input_key", "prompt", "--output_key", "answer",
        "--max_len", "32", "--train_batch_size", "32", "--micro_train_batch_size", "32",
        "--input_template", "{}", "--max_epochs", str(c.sft_epochs), "--learning_rate", str(c.sft_learning_rate),
        "--lr_warmup_ratio", "0.05", "--seed", str(c.seed), "--logging_steps", "10", "--save_path", str(out),
    ]))  # fmt: skip
    return out


def parameters(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def one_run(args, family: str, seed: int) -> dict:
    """SFT then GRPO of ``family``'s tiny model at ``seed``: parameters, accuracies before and after GRPO."""
    from tidal.cli.demo import Demo, DemoConfig
    from tidal.testing import build_tiny_model

    root = Path(args.root) / f"{family}_seed{seed}"
    demo = Demo(DemoConfig(
        output_dir=str(root), family=family, seed=seed, train_samples=args.train_samples,
        eval_samples=args.eval_samples, sft_epochs=args.sft_epochs, rl_rollouts=args.rollouts,
        skip_preference=True,
    ))  # fmt: skip
    start = time.perf_counter()
    base = build_tiny_model(root / "base", family, seed=seed)
    sft_model = sft(demo, base)
    before = demo.accuracy(sft_model)
    after = demo.accuracy(demo.rl(sft_model))
    return {"params": parameters(base), "before": before, "after": after, "s": time.perf_counter() - start}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    results = {
        f: {"before": {k: [] for k in KEYS}, "after": {k: [] for k in KEYS}, "s": []} for f in FAMILIES
    }
    for seed in args.seeds:
        for family in FAMILIES:
            run = one_run(args, family, seed)
            entry = results[family]
            entry["params"] = run["params"]
            entry["s"].append(round(run["s"], 1))
            for when in ("before", "after"):
                for key in KEYS:
                    entry[when][key].append(round(run[when][key], 4))
            print(f"seed {seed} {family}: {run}", file=sys.stderr, flush=True)
    for entry in results.values():
        for when in ("before", "after"):
            entry[when].update({f"mean_{k}": round(statistics.mean(entry[when][k]), 4) for k in KEYS})
    out = {
        "bench": "family_learning", "seeds": args.seeds, "train_samples": args.train_samples,
        "sft_epochs": args.sft_epochs, "rollouts": args.rollouts, "eval_samples": args.eval_samples,
        "threads": args.threads, **results,
    }  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
