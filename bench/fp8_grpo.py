"""Benchmark: GRPO with FP8 rollouts learns as GRPO with model-dtype rollouts does (same SFT model, seeds, steps).

The demo's task (``tidal.cli.demo``: noisy-label SFT on addition, then GRPO with a rule reward), per seed:
the SFT model is trained once; then, on that trained model, greedy agreement of the FP8 engine with the
model-dtype engine on the held-out prompts (``bench/fp8_rollout.py``'s ``agreement``: whole samples equal,
share of tokens before the first difference, mean |log-prob difference| before it); then GRPO runs twice
from it, same seed and steps: rollouts in the model dtype (bf16 on CUDA), and with
``--rollout_quantization`` (``fp8`` by default) and ``--enable_vllm_is_correction`` (TIS). The held-out
accuracy of each trained model (greedy and sampled at T=1, the demo's CPU engine) is compared.

Prints one JSON line. Everything runs on the default device (CUDA when present; on the CPU FP8 is emulated).

    python bench/fp8_grpo.py --seeds 0 --rollouts 32                          # one H200: a few minutes
    python bench/fp8_grpo.py --seeds 0 --rollouts 2 --train_samples 256 --sft_epochs 1 --eval_samples 32  # CPU smoke
    python bench/fp8_grpo.py --seeds 0 1 2 --rollouts 32 --kv_cache_dtype fp8   # FP8 weights and KV cache

``--kv_cache_dtype fp8``: the FP8 engine (its agreement and its GRPO run) also keeps an FP8 KV cache
(``--rollout_kv_cache_dtype fp8``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_rollout import agreement  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--rollouts", type=int, default=32, help="GRPO steps (32 prompts x 8 samples)")
    p.add_argument("--quantization", default="fp8", choices=["fp8", "fp8_block"])
    p.add_argument(
        "--kv_cache_dtype", default="auto", choices=["auto", "fp8"], help="fp8: the FP8 runs' cache too"
    )
    p.add_argument("--train_samples", type=int, default=4096, help="the demo's SFT samples")
    p.add_argument("--sft_epochs", type=int, default=4)
    p.add_argument("--eval_samples", type=int, default=200, help="held-out prompts")
    p.add_argument("--root", default="./runs/fp8_grpo")
    return p.parse_args(argv)


def demo(root: Path, seed: int, args):
    from tidal.cli.demo import Demo, DemoConfig

    return Demo(DemoConfig(output_dir=str(root), seed=seed, rl_rollouts=args.rollouts, skip_preference=True,
                           train_samples=args.train_samples, sft_epochs=args.sft_epochs,
                           eval_samples=args.eval_samples))  # fmt: skip


def sft_agreement(
    model: Path, prompts: list[str], quantization: str, seed: int, new_tokens: int, kv_cache_dtype: str
) -> dict:
    """Greedy samples of the trained model by the model-dtype and the FP8 engine, compared."""
    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    samples = {}
    for label in ("none", quantization):
        kv = "auto" if label == "none" else kv_cache_dtype
        engine = LLMEngine(str(model), EngineConfig(seed=seed, quantization=label, kv_cache_dtype=kv))
        samples[label] = [o.outputs[0] for o in engine.generate(prompts, params)]
        modes = getattr(engine.model, "fp8", None)
    return {**agreement(samples["none"], samples[quantization]), "modes": modes.modes() if modes else None}


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tidal.testing import build_tiny_model

    modes = ("none", args.quantization)
    runs: dict[str, dict[str, list]] = {m: {"greedy": [], "sampled": []} for m in modes}
    quality = []
    for seed in args.seeds:
        root = Path(args.root) / f"seed{seed}"
        first = demo(root, seed, args)
        sft = first.sft(build_tiny_model(root / "base", "qwen2", seed=seed))
        prompts = [s["prompt"] for s in first.held_out]
        quality.append(
            sft_agreement(sft, prompts, args.quantization, seed, first.cfg.digits + 3, args.kv_cache_dtype)
        )
        for mode in modes:
            extra = [] if mode == "none" else ["--rollout_quantization", mode, "--enable_vllm_is_correction"]
            if mode != "none" and args.kv_cache_dtype == "fp8":
                extra += ["--rollout_kv_cache_dtype", "fp8"]
            run = demo(root / f"rl_{mode}", seed, args)
            model = run.rl(sft, *extra)
            accuracy = run.accuracy(model)
            for key in ("greedy", "sampled"):
                runs[mode][key].append(round(accuracy[key], 4))
            print(f"seed {seed} {mode}: {accuracy}", file=sys.stderr, flush=True)
    for r in runs.values():
        r.update({f"mean_{k}": round(statistics.mean(r[k]), 4) for k in ("greedy", "sampled")})
    result = {
        "bench": "fp8_grpo",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "seeds": args.seeds,
        "rollouts": args.rollouts,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "sft_agreement": quality,
        "base": runs["none"],
        "fp8": runs[args.quantization],
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
