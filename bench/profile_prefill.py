"""Profile: where the prefill of tidal's rollout engine spends its time (``bench/profile_decode.py``'s
sibling, with its shapes, options and kernel categories).

Builds the engine on a random-init model, warms it up, then prefills ``--batch`` prompts of
``--prompt_len`` random tokens (one token generated each, so every step is a prefill of up to
``--max_num_batched_tokens`` prompt tokens) twice: timed (``prefill_s``, the whole run's wall time), and
under ``torch.profiler`` (every kernel's time per prefill step, grouped: ``kernel_ms``, ``busy_ms``).
Prints one JSON line per setting; the top kernels on stderr.

``--flash_prefill both`` measures a prefill without context on torch's varlen flash attention
(``runner/attention.FLASH_PREFILL``, the default on CUDA in half precision) and on the padded, masked
SDPA call, one engine each.

    python bench/profile_prefill.py --config qwen2.5-7b --batch 64 --prompt_len 1024 --flash_prefill both
    python bench/profile_prefill.py --config qwen2.5-7b --batch 64 --prompt_len 1024 --quantization fp8 \\
        --kv_cache_dtype fp8
    python bench/profile_prefill.py   # tiny model on the CPU (plumbing check; CPU "kernels" are ops)
"""

from __future__ import annotations

import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_decode import (  # noqa: E402
    SETTINGS,
    build_engine,
    build_parser,
    kernel_profile,
    on_off_both,
    report,
    sync,
)


def parse_args(argv=None):
    """``profile_decode``'s engine and model options, and two of its own."""
    p = build_parser(__doc__)
    p.add_argument("--max_num_batched_tokens", type=int, default=16384, help="prompt tokens per prefill step")
    on_off_both(
        p,
        "--flash_prefill",
        "a prefill without context on torch's varlen flash attention (CUDA, half precision) or the padded "
        "SDPA call; both: each in turn",
    )
    p.set_defaults(steps=0)  # no decode steps (``build_engine`` sizes the context for --steps more tokens)
    return p.parse_args(argv)


def measure(args, flash_on: bool) -> dict:
    """One engine: a warm-up prefill, the timed one, the profiled one."""
    from tidal.rollout import SamplingParams
    from tidal.rollout.runner import attention

    attention.FLASH_PREFILL = flash_on
    with tempfile.TemporaryDirectory() as tmp:
        engine, vocab = build_engine(args, tmp, max_num_batched_tokens=args.max_num_batched_tokens)
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(5, min(vocab, 100_000), (args.batch, args.prompt_len), generator=gen).tolist()
        params = SamplingParams(temperature=args.temperature, max_new_tokens=1, ignore_eos=True)
        engine.generate(prompts[: max(1, args.batch // 8)], params)  # warm-up: kernel selection, allocations
        # counted: generate's engine steps, and the prefill attention calls that took flash
        with (
            mock.patch.object(engine, "_advance", wraps=engine._advance) as advance,
            mock.patch.object(
                attention, "flash_prefill_attention", wraps=attention.flash_prefill_attention
            ) as flash,
        ):
            sync(args.device)
            start = time.perf_counter()
            engine.generate(prompts, params)
            sync(args.device)
            wall = time.perf_counter() - start
        per_run = advance.call_count
        kernels, top, busy = kernel_profile(engine, args, partial(engine.generate, prompts, params), per_run)
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    result = {
        "bench": "profile_prefill",
        "model": args.config or "tiny-qwen2",
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "flash_prefill": flash_on,
        "flash_taken": flash.call_count > 0,  # False where flash does not apply (the CPU, float32, ...)
        "prefill_s": round(wall, 4),
        "steps": per_run,
        "kernel_ms": kernels,  # per prefill step
        "busy_ms": round(busy, 4),
        "torch": torch.__version__,
    }
    return report(f"flash_prefill={flash_on}", top, result)


def main(argv=None) -> dict | list[dict]:
    args = parse_args(argv)
    results = [measure(args, flash) for flash in SETTINGS[args.flash_prefill]]
    return results[0] if len(results) == 1 else results


if __name__ == "__main__":
    main()
