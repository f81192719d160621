"""Benchmark: tidal's rollout engine vs ``transformers.generate`` on the same prompts, in one run.

Greedy decoding (``--temperature`` > 0: sampling), every sample runs exactly ``--new_tokens`` tokens (our engine: ``ignore_eos``; HF:
``min_new_tokens``). Prints one JSON line with generated tokens/s of both and the ratio (ours / HF), and
for our engine:

- ``decode_step_ms``: (time of the full run - time of a prefill-only run) / (new_tokens - 1);
- ``roofline_fraction``: bytes one decode step must read (every weight once, plus the KV cache of the
  average context, prompt_len + new_tokens / 2) / decode step time, over ``--peak_tb_s`` (4.3 TB/s: the
  device-to-device copy bandwidth measured on the H200);
- ``update_weights_ms``: ``engine.update_weights(hf_model.named_parameters())``, tensors on the device;
- ``graph_pool_mb``: memory held by the CUDA graph of the benchmark's batch bucket.

``--tp_size N``: a tensor-parallel engine over N GPUs (from ``--device``'s); the decode bytes are then one
rank's (its weight shard and the KV cache of its KV heads), so ``roofline_fraction`` is per GPU.

``--async_scheduling off|on|both``: our engine with the synchronous loop, with async scheduling (decode step
t+1 launched while the device runs step t), or both in one run (two engines, timed runs interleaved): the
top-level fields are then the synchronous engine's, ``async_on`` has the async engine's timings, the
steps it launched ahead and used, and ``same_outputs`` (token ids and log-probs equal to the synchronous
run's, as they must be). ``--stop_fraction F`` makes the last ``F`` of the vocabulary stop tokens (sampling
on a random-init model: each sample stops with probability about ``F`` per token, as eos ends RL samples
at different steps; steps launched ahead after a stop are discarded); ``tidal_tokens_per_s`` then counts
the tokens generated (use with ``--skip_hf``).

``--hf_new_tokens`` caps HF's run (its tokens/s is then measured over that many new tokens, which flatters
HF: its per-token cost grows with the context); ``--skip_hf`` leaves HF out.

    python bench/rollout.py                                    # tiny qwen2 model on CPU, < 1 minute
    python bench/rollout.py --batch 16 --prompt_len 32 --new_tokens 64 --threads 1 --repeats 3
    python bench/rollout.py --config qwen2.5-0.5b --device cuda --batch 256 --prompt_len 128 --new_tokens 512
    python bench/rollout.py --config qwen2.5-0.5b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --skip_hf --async_scheduling both --temperature 1.0
    python bench/rollout.py --config qwen2.5-7b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --hf_new_tokens 64
    python bench/rollout.py --model path/to/hf_folder --device cuda --dtype bfloat16
    python bench/rollout.py --config qwen2.5-14b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --skip_hf --tp_size 2
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen2.5-0.5B's shapes, for a random-init model (no hub access needed).
CONFIGS = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen2.5-7B's shapes.
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Qwen2.5-14B's shapes.
    "qwen2.5-14b": dict(
        model_type="qwen2",
        hidden_size=5120,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=13824,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF model folder")
    source.add_argument("--config", choices=sorted(CONFIGS), help="random-init model of this shape")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine (best is reported)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--hf_new_tokens", type=int, default=0, help="cap HF's new tokens (0: --new_tokens)")
    p.add_argument("--skip_hf", action="store_true", help="time our engine only")
    p.add_argument("--enforce_eager", action="store_true", help="our engine without CUDA graphs")
    p.add_argument("--attention_backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--tp_size", type=int, default=1, help="tensor-parallel engine over this many GPUs")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="> 0: sample (both engines) instead of greedy"
    )
    p.add_argument(
        "--async_scheduling",
        default="off",
        choices=["off", "on", "both"],
        help="our engine's loop: synchronous, async scheduling (the engine's default on CUDA), or both in one run",
    )
    p.add_argument(
        "--stop_fraction", type=float, default=0.0, help="the last fraction of the vocabulary stops a sample"
    )
    p.add_argument("--peak_tb_s", type=float, default=4.3, help="memory bandwidth for the roofline")
    return p.parse_args(argv)


def load_hf_model(args, dtype: torch.dtype, tmp: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(
            args.device
        ).eval(), args.model
    if args.config:
        fields = dict(CONFIGS[args.config])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval(), None
    from tidal.testing import build_tiny_model

    path = build_tiny_model(Path(tmp) / "tiny", "qwen2", seed=args.seed)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(args.device).eval(), str(path)


def timed(fn, device: str) -> tuple[float, object]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def decode_bytes(engine, batch: int, avg_context: float) -> float:
    """Bytes one decode step must read: every weight once (an untied input embedding only reads
    ``batch`` rows) plus the KV cache of ``avg_context`` tokens per sequence."""
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.args.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    kv_per_token = type(engine.runner).bytes_per_block(model.args, 1, engine.dtype)
    return weights + batch * avg_context * kv_per_token


def graph_pool_mb(engine, batch: int) -> float | None:
    """Memory the CUDA graph of ``batch``'s bucket holds (captured afresh between two empty_cache)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    graphs.clear()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with torch.inference_mode():
        graphs._capture(graphs.bucket(batch))
    torch.cuda.empty_cache()
    return round((torch.cuda.memory_reserved() - before) / 2**20, 1)


def update_weights_ms(engine, hf, device: str) -> float:
    runs = [timed(lambda: engine.update_weights(hf.named_parameters()), device)[0] for _ in range(3)]
    return round(min(runs) * 1e3, 2)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    hf_new = args.hf_new_tokens or args.new_tokens
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf, path = load_hf_model(args, dtype, tmp)
        vocab = hf.config.vocab_size
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(5, min(vocab, 100_000), (args.batch, args.prompt_len), generator=gen)
        configs = {
            label: EngineConfig(
                max_num_seqs=args.batch,
                max_model_len=args.prompt_len + args.new_tokens,
                dtype=str(dtype).removeprefix("torch."),
                device=args.device,
                seed=args.seed,
                enforce_eager=args.enforce_eager,
                attention_backend=args.attention_backend,
                tp_size=args.tp_size,
                async_scheduling=label == "on",
            )
            for label in (["off", "on"] if args.async_scheduling == "both" else [args.async_scheduling])
        }
        engines = {label: LLMEngine(path, config, model=hf) for label, config in configs.items()}
        engine = next(iter(engines.values()))
        ids = prompts.to(args.device)
        stops = list(range(vocab - round(args.stop_fraction * vocab), vocab))

        def run_hf(n=hf_new):
            with torch.inference_mode():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=args.temperature > 0,
                    temperature=args.temperature or None,
                    top_k=None,
                    max_new_tokens=n,
                    min_new_tokens=n,
                )
            return out[:, args.prompt_len :].tolist()

        def run_ours(n=args.new_tokens, engine=engine):
            params = SamplingParams(
                temperature=args.temperature, max_new_tokens=n, ignore_eos=True, stop_token_ids=stops
            )
            return [o.outputs[0] for o in engine.generate(prompts.tolist(), params)]

        if not args.skip_hf:
            run_hf(4)  # warm-up: first-call allocations and kernel selection stay out of the timings
        for each in engines.values():
            run_ours(4, each)
        # Interleave the timed runs so that load changes on a shared machine hit all engines alike.
        hf_runs, runs = [], {label: ([], []) for label in engines}
        for _ in range(args.repeats):
            if not args.skip_hf:
                hf_runs.append(timed(run_hf, args.device))
            for label, each in engines.items():
                runs[label][0].append(timed(lambda each=each: run_ours(engine=each), args.device))
                runs[label][1].append(timed(lambda each=each: run_ours(1, each), args.device))
        timings = {
            label: (*min(full, key=lambda r: r[0]), min(r[0] for r in prefill))
            for label, (full, prefill) in runs.items()
        }
        our_time, our_samples, prefill_time = next(iter(timings.values()))
        our_out = [s.token_ids for s in our_samples]
        generated = sum(len(s.token_ids) for s in our_samples)
        update_ms = update_weights_ms(engine, hf, args.device)
        pool_mb = graph_pool_mb(engine, args.batch) if args.device.startswith("cuda") else None
        step_s = (our_time - prefill_time) / max(1, args.new_tokens - 1)
        step_bytes = decode_bytes(engine, args.batch, args.prompt_len + args.new_tokens / 2)
        if args.async_scheduling == "both":
            on_time, on_samples, on_prefill = timings["on"]
            on_step_s = (on_time - on_prefill) / max(1, args.new_tokens - 1)
            stats = engines["on"].ahead_stats
            async_on = {
                "tidal_tokens_per_s": round(sum(len(s.token_ids) for s in on_samples) / on_time, 1),
                "tidal_s": round(on_time, 3),
                "prefill_s": round(on_prefill, 4),
                "decode_step_ms": round(on_step_s * 1e3, 3),
                "roofline_fraction": round(step_bytes / on_step_s / (args.peak_tb_s * 1e12), 3),
                "steps_launched_ahead": stats.launched,
                "steps_used": stats.used,
                # Repeat by repeat: unseeded requests draw their seeds from the engine's generator, so
                # the k-th runs of the two engines share seeds (the fastest runs may not).
                "same_outputs": all(
                    [(s.token_ids, s.logprobs) for s in off_run[1]]
                    == [(s.token_ids, s.logprobs) for s in on_run[1]]
                    for off_run, on_run in zip(runs["off"][0], runs["on"][0], strict=True)
                ),
            }
        for each in engines.values():
            each.close()
    result = {
        "bench": "rollout",
        "model": args.model or args.config or "tiny-qwen2",
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "enforce_eager": args.enforce_eager,
        "attention_backend": engine.runner.backend,
        "tp_size": args.tp_size,
        "async_scheduling": args.async_scheduling,
        "stop_fraction": args.stop_fraction,
        "tidal_tokens_per_s": round(generated / our_time, 1),
        "tidal_s": round(our_time, 3),
        "prefill_s": round(prefill_time, 4),
        "decode_step_ms": round(step_s * 1e3, 3),
        "decode_gb_per_step": round(step_bytes / 1e9, 3),
        "roofline_fraction": round(step_bytes / step_s / (args.peak_tb_s * 1e12), 3),
        "update_weights_ms": update_ms,
        "graph_pool_mb": pool_mb,
    }
    if args.async_scheduling == "both":
        result["async_on"] = async_on
    if hf_runs:
        hf_time, hf_out = min(hf_runs, key=lambda r: r[0])
        hf_rate = args.batch * hf_new / hf_time
        common = min(hf_new, args.new_tokens)
        matches = [a[:common] == b[:common] for a, b in zip(our_out, hf_out, strict=True)]
        result.update(
            hf_new_tokens=hf_new,
            hf_tokens_per_s=round(hf_rate, 1),
            hf_s=round(hf_time, 3),
            ratio=round(result["tidal_tokens_per_s"] / hf_rate, 3),
            greedy_match=round(sum(matches) / args.batch, 3),
        )
    result.update(torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine())
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
