"""Benchmark: FP8 rollouts (``--rollout_quantization``) against the model dtype, one model, one run.

The same weights go into two engines, one after the other (only one engine is on the device at a time):
the model dtype (bf16 on CUDA) and FP8 (``--quantization fp8``: per-output-channel scales, or
``fp8_block``). Each runs a warm-up, then ``--repeats`` timed greedy runs of ``--new_tokens`` tokens for
``--batch`` prompts (``ignore_eos``) and a prefill-only run. Prints one JSON line with, per engine:

- ``tokens_per_s`` and ``decode_step_ms`` ((full run - prefill-only run) / (new_tokens - 1));
- ``sync_ms``: ``update_weights(hf.named_parameters())`` (best of 3), which for FP8 includes quantizing
  every linear layer and expert on the device (``sync_from_host``: the HF model was moved to host memory
  first because two copies would not fit the GPU, so the sync also copies host to device);
- ``weights_gb``: the engine's parameters and FP8 buffers (on CUDA the FP8 engine frees the model-dtype
  copies of the weights it quantizes; on the CPU it keeps the rounded weights in the model dtype), and for FP8 ``modes``: how many modules run ``torch._scaled_mm`` / the FP8 Triton MoE
  kernels / the emulation;

and ``fp8_speedup`` (FP8 tokens/s over the model dtype's), ``greedy_match`` (fraction of samples whose
tokens are all equal), ``agreeing_tokens`` (mean fraction of each sample before its first different
token) and ``mean_abs_logprob_diff`` (mean |log-prob difference| of the tokens before that point, where
both engines scored the same token after the same context). ``--kv_cache_dtype fp8`` adds a third
engine, FP8 weights and an FP8 KV cache (``kv_cache_dtype``), reported as ``fp8_kv`` with its own
``fp8_kv_speedup`` and agreement with the model dtype (``fp8_kv_agreement``). ``kv_tokens`` is each engine's
cache capacity; with a small ``--gpu_memory_utilization`` (a colocated trainer's share) it, not
``--batch``, bounds how many sequences decode together. On a random-init model (``--config``) the
logits are nearly flat and greedy agreement says little; ``--model`` takes a trained HF folder.

Shapes: ``--config`` Qwen2.5-0.5B / 7B (``bench/rollout.py``), a Qwen3-MoE shape (``bench/moe.py``:
``qwen3-30b-a3b``, ``qwen3-moe-2b``) or a 2025 family's (``bench/family_shapes.py``: ``gpt-oss-20b``,
``qwen3.5-*``); ``--tiny`` (the default) a tiny qwen2 on the CPU, where FP8 is
emulated (a smoke run: no speed-up is expected there).

    python bench/fp8_rollout.py                                  # CPU smoke run, < 1 minute
    python bench/fp8_rollout.py --config qwen2.5-7b --device cuda --batch 256 --prompt_len 128 --new_tokens 512
    python bench/fp8_rollout.py --config qwen2.5-7b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --kv_cache_dtype fp8
    python bench/fp8_rollout.py --config qwen2.5-7b --device cuda --batch 256 --prompt_len 128 --new_tokens 1024 \
        --kv_cache_dtype fp8 --gpu_memory_utilization 0.05
    python bench/fp8_rollout.py --config qwen3-30b-a3b --device cuda --batch 256 --prompt_len 128 \\
        --new_tokens 256
    python bench/fp8_rollout.py --config gpt-oss-20b --device cuda --batch 256 --prompt_len 128 --new_tokens 256
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_shapes import FAMILY_SHAPES, family_config  # noqa: E402
from moe import MOE_CONFIGS, moe_config  # noqa: E402
from rollout import CONFIGS, needs_offload, offload, timed  # noqa: E402

SHAPES = ["qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b", *MOE_CONFIGS, *FAMILY_SHAPES]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF model folder (a trained model: meaningful greedy agreement)")
    source.add_argument("--config", choices=SHAPES, help="random-init model of this shape")
    source.add_argument("--tiny", default="qwen2", metavar="MODEL_TYPE", help="tidal.testing's tiny model")
    p.add_argument("--quantization", default="fp8", choices=["fp8", "fp8_block"])
    p.add_argument(
        "--kv_cache_dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="fp8: a third engine, FP8 weights and KV",
    )
    p.add_argument(
        "--gpu_memory_utilization",
        type=float,
        default=0.5,
        help="the engines' KV budget, a fraction of the free memory after weights (--vllm_gpu_memory_utilization); "
        "small: the cache, not --batch, bounds how many sequences decode together",
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine (the best is reported)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    return p.parse_args(argv)


def load_hf(args, dtype: torch.dtype, tmp: str):
    """(HF model, its folder or None): a folder, a random-init shape built on the device, or a tiny model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(
            args.device
        ).eval(), args.model
    if args.config:
        if args.config in MOE_CONFIGS:
            config = moe_config(args.config)
        elif args.config in FAMILY_SHAPES:
            config = family_config(args.config)
        else:
            fields = dict(CONFIGS[args.config])
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), None
    from tidal.testing import build_tiny_model

    path = build_tiny_model(Path(tmp) / "tiny", args.tiny, seed=args.seed)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(args.device).eval(), str(path)


def engine_bytes(engine) -> int:
    tensors = [*engine.model.parameters(), *(b for n, b in engine.model.named_buffers() if ".fp8_" in n)]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(engine, hf, prompts: list[list[int]], args) -> dict:
    """Timed greedy runs, the prefill-only run and the weight sync of one engine; its samples."""
    from tidal.rollout import SamplingParams

    def run(n: int):
        params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        return [o.outputs[0] for o in engine.generate(prompts, params)]

    run(4)  # warm-up: CUDA graphs, kernel selection
    full = min(
        (timed(lambda: run(args.new_tokens), args.device) for _ in range(args.repeats)), key=lambda r: r[0]
    )
    prefill = min(timed(lambda: run(1), args.device)[0] for _ in range(args.repeats))
    sync = min(timed(lambda: engine.update_weights(hf.named_parameters()), args.device)[0] for _ in range(3))
    seconds, samples = full
    result = {
        "tokens_per_s": round(len(prompts) * args.new_tokens / seconds, 1),
        "decode_step_ms": round((seconds - prefill) / max(1, args.new_tokens - 1) * 1e3, 3),
        "prefill_s": round(prefill, 4),
        "sync_ms": round(sync * 1e3, 2),
        "weights_gb": round(engine_bytes(engine) / 1e9, 3),
        "cuda_graphs": engine.runner.graphs is not None,
        "kv_tokens": engine.num_kv_blocks * engine.config.block_size,  # the cache's capacity
    }
    fp8 = getattr(engine.model, "fp8", None)
    if fp8 is not None:
        result["modes"] = fp8.modes()
    return {"result": result, "samples": samples}


def agreement(base, fp8) -> dict:
    """Greedy agreement of the FP8 samples with the model dtype's and the mean |log-prob difference| of the
    tokens both scored after the same context (those before the first different token)."""
    same, fractions, diffs = 0, [], []
    for a, b in zip(base, fp8, strict=True):
        length = len(a.token_ids)
        first = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), length
        )
        same += first == length
        fractions.append(first / length)
        diffs += [abs(p - q) for p, q in zip(a.logprobs[:first], b.logprobs[:first], strict=True)]
    return {
        "greedy_match": round(same / len(base), 3),
        "agreeing_tokens": round(sum(fractions) / len(fractions), 3),
        "mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 5) if diffs else None,
    }


def fp8_kv_fields(runs: dict, base: dict) -> dict:
    """The FP8-weights-and-KV engine's result, speed-up and agreement with the model dtype (if it ran)."""
    if "fp8_kv" not in runs:
        return {}
    run = runs["fp8_kv"]
    return {
        "fp8_kv": run["result"],
        "fp8_kv_speedup": round(run["result"]["tokens_per_s"] / base["result"]["tokens_per_s"], 3),
        "fp8_kv_agreement": agreement(base["samples"], run["samples"]),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tidal.rollout import EngineConfig, LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        hf, path = load_hf(args, dtype, tmp)
        vocab = hf.config.get_text_config().vocab_size
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(5, min(vocab, 100_000), (args.batch, args.prompt_len), generator=gen).tolist()
        # The FP8 engine loads the model-dtype weights before it quantizes them (1.5x at the peak): keep the
        # HF copy on the host when both would not fit.
        from_host = needs_offload(hf, args.device) or (
            args.device.startswith("cuda")
            and 2.5 * sum(p.numel() * p.element_size() for p in hf.parameters())
            > 0.8 * torch.cuda.get_device_properties(args.device).total_memory
        )
        if from_host:
            offload(hf)
        runs = {}
        engines = {"none": ("none", "auto"), args.quantization: (args.quantization, "auto")}
        if args.kv_cache_dtype == "fp8":
            engines["fp8_kv"] = (args.quantization, "fp8")
        for label, (quantization, kv_cache_dtype) in engines.items():
            config = EngineConfig(
                max_num_seqs=args.batch,
                max_model_len=args.prompt_len + args.new_tokens,
                dtype=str(dtype).removeprefix("torch."),
                device=args.device,
                seed=args.seed,
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
                gpu_memory_utilization=args.gpu_memory_utilization,
            )
            engine = LLMEngine(path, config, model=hf)
            runs[label] = measure(engine, hf, prompts, args)
            engine.close()
            del engine
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    base, fp8 = runs["none"], runs[args.quantization]
    result = {
        "bench": "fp8_rollout",
        "model": args.model or args.config or f"tiny-{args.tiny}",
        "quantization": args.quantization,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "sync_from_host": from_host,
        "base": base["result"],
        "fp8": fp8["result"],
        "fp8_speedup": round(fp8["result"]["tokens_per_s"] / base["result"]["tokens_per_s"], 3),
        **agreement(base["samples"], fp8["samples"]),
        **fp8_kv_fields(runs, base),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
