"""Benchmark: tidal's rollout engine vs ``transformers.generate`` on the same prompts, in one run.

Greedy decoding (``--temperature`` > 0: sampling), every sample runs exactly ``--new_tokens`` tokens (our engine: ``ignore_eos``; HF:
``min_new_tokens``). Prints one JSON line with generated tokens/s of both and the ratio (ours / HF), and
for our engine:

- ``decode_step_ms``: (time of the full run - time of a prefill-only run) / (new_tokens - 1);
- ``roofline_fraction``: bytes one decode step must move (``bench/decode_roofline.py``: every weight
  once, of an MoE's routed experts those the batch's tokens pick, the KV cache of each attention layer
  over the context up to its sliding window, linear-attention layers' recurrent states read and written;
  split by part in ``decode_gb``) / decode step time, over ``--peak_tb_s`` (4.3 TB/s: the
  device-to-device copy bandwidth measured on the H200);
- ``cuda_graphs`` / ``engine_async``: whether the engine's decode steps ran in CUDA graphs and were
  launched ahead (a family may refuse either: ``registry.Family.refuses``);
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

Random-init shapes (``--config``): Qwen2.5's here, and the issue #31 families' from
``bench/family_shapes.py`` (``qwen3.5-0.8b``, ``qwen3.5-9b``, ``qwen3.5-35b-a3b``, ``gpt-oss-20b``, bf16 and
not MXFP4), built directly on the device. No checkpoint is written: the engine copies the HF model's
weights. When two copies would not fit the GPU (the 35B MoE), HF's runs come first, then the HF model
moves to host memory before the engine is built (``hf_offloaded``; ``update_weights_ms`` is then not
measured). For MoE models on CUDA, HF runs its experts with ``grouped_mm`` throughout
(``bench/moe.py``'s ``keep_grouped_mm``: ``generate``'s default ``batched_mm`` copies each token's
experts' weights and runs out of memory at batch 256). ``hf_kernels`` records the path HF's Gated
DeltaNet layers took: flash-linear-attention's kernels when ``fla`` is importable, else transformers'
torch fallback, which is what a user without ``fla`` gets; ``engine_fla`` whether the engine ran fla's
(``TIDAL_FLA=1``), ``engine_gdn_decode`` which path ran the engine's decode steps (``triton``: its fused
kernel, the CUDA default; ``TIDAL_GDN_KERNEL=0``: ``torch``).

``--hf_new_tokens`` caps HF's run (its tokens/s is then measured over that many new tokens, which flatters
HF: its per-token cost grows with the context); ``--skip_hf`` leaves HF out.

    python bench/rollout.py                                    # tiny qwen2 model on CPU, < 1 minute
    python bench/rollout.py --tiny qwen3_5_text                # any family's tiny model (CPU smoke run)
    python bench/rollout.py --batch 16 --prompt_len 32 --new_tokens 64 --threads 1 --repeats 3
    python bench/rollout.py --config qwen2.5-0.5b --device cuda --batch 256 --prompt_len 128 --new_tokens 512
    python bench/rollout.py --config qwen2.5-0.5b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --skip_hf --async_scheduling both --temperature 1.0
    python bench/rollout.py --config qwen2.5-7b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --hf_new_tokens 64
    python bench/rollout.py --model path/to/hf_folder --device cuda --dtype bfloat16
    python bench/rollout.py --config qwen2.5-14b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --skip_hf --tp_size 2
    python bench/rollout.py --config qwen3.5-0.8b --device cuda --batch 256 --prompt_len 128 --new_tokens 512 \
        --hf_new_tokens 128
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_roofline import decode_bytes  # noqa: E402
from family_shapes import FAMILY_SHAPES  # noqa: E402

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
    **FAMILY_SHAPES,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF model folder")
    source.add_argument("--config", choices=sorted(CONFIGS), help="random-init model of this shape")
    source.add_argument(
        "--tiny", metavar="MODEL_TYPE", help="tidal.testing's tiny model of this family (the default: qwen2)"
    )
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
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "fp8"],
        help="our engine's rollout weights (--rollout_quantization): model dtype or FP8 (per-channel scales)",
    )
    p.add_argument(
        "--gpu_memory_utilization",
        type=float,
        default=0.5,
        help="our engine's share of the free GPU memory (after weights) for the KV cache and recurrent states "
        "(the engine's default 0.5; qwen3.5-35b-a3b at batch 256 needs ~0.9: its 513 state slots take ~31 GB)",
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

    path = build_tiny_model(Path(tmp) / "tiny", args.tiny or "qwen2", seed=args.seed)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(args.device).eval(), str(path)


def timed(fn, device: str) -> tuple[float, object]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def hf_kernel_origin(fn) -> str:
    """Where transformers' kernel-or-fallback function ``fn`` resolved to at import: the package's kernel
    (its module), or "torch fallback"."""
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))
    if "implementation" not in cells:
        return "unknown"
    impl = cells["implementation"]
    return f"{impl.__module__}.{impl.__name__}" if cells.get("is_new_implementation") else "torch fallback"


def hf_kernels(hf) -> dict | None:
    """For a model with Gated DeltaNet layers (Qwen3.5): the implementation each of transformers'
    delta-rule and convolution functions took (flash-linear-attention's / causal-conv1d's or the torch
    fallback); None for other models."""
    layer = next((m for m in hf.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    return None if layer is None else module_kernels(sys.modules[type(layer).__module__])


def module_kernels(module) -> dict:
    """The implementation each Gated DeltaNet function of a transformers modeling ``module`` took."""
    names = (
        "chunk_gated_delta_rule",
        "recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    found = {name: getattr(module, f"torch_{name}", None) or getattr(module, name, None) for name in names}
    return {name: hf_kernel_origin(fn) for name, fn in found.items() if fn is not None}


def hf_experts(hf, device: str) -> str | None:
    """MoE models on CUDA: keep transformers' grouped_mm experts throughout ``generate`` (its default swaps
    in batched_mm, which copies every token's experts' weights: out of memory at batch 256); the
    implementation used, or the reason it could not be set. None for dense models."""
    if not any(type(m).__name__.endswith("Experts") for m in hf.modules()):
        return None
    if not device.startswith("cuda"):
        return getattr(hf.config, "_experts_implementation", None)
    from moe import HF_GROUPED_ALIAS, keep_grouped_mm

    problem = keep_grouped_mm(hf)
    return f"default ({problem})" if problem else HF_GROUPED_ALIAS


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def needs_offload(hf, device: str) -> bool:
    """Whether the HF model and the engine's copy of it would not both fit the GPU with room for the KV
    cache and HF's activations (then HF runs first and moves to host memory)."""
    if not device.startswith("cuda"):
        return False
    return 2 * model_bytes(hf) > 0.7 * torch.cuda.get_device_properties(device).total_memory


def offload(hf) -> float:
    """Move the HF model to host memory; returns the GiB of tensors still allocated on the GPU (what the
    engine's KV cache cannot have), listing the largest when over 1 GiB."""
    hf.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated() / 2**30
    if left > 1:
        print(
            f"after offloading the HF model {left:.1f} GiB stay allocated on the GPU; largest:",
            file=sys.stderr,
        )
        live = [o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda]
        for tensor in sorted(live, key=lambda o: -o.untyped_storage().nbytes())[:8]:
            print(f"  {tuple(tensor.shape)} {tensor.dtype}", file=sys.stderr)
    return round(left, 2)


def engine_fla(engine) -> bool | None:
    """Linear-attention models: whether the engine ran flash-linear-attention's kernels (``TIDAL_FLA=1``,
    CUDA, ``fla`` installed); None for other models."""
    from tidal.rollout.models.gated_delta import USE_FLA, fla_installed

    if engine.model.state_spec() is None:
        return None
    return USE_FLA and engine.device.type == "cuda" and fla_installed()


def engine_gdn_decode(engine) -> str | None:
    """Linear-attention models: which path ran the Gated DeltaNet decode steps ("triton": tidal's fused
    kernel, "fla", "torch"; ``gated_delta.decode_path``); None for other models."""
    from tidal.rollout.models.gated_delta import decode_path

    if engine.model.state_spec() is None:
        return None
    return decode_path(torch.empty(0, device=engine.device))


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
        vocab, model_type = hf.config.vocab_size, hf.config.model_type
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
                quantization=args.quantization,
                gpu_memory_utilization=args.gpu_memory_utilization,
            )
            for label in (["off", "on"] if args.async_scheduling == "both" else [args.async_scheduling])
        }
        hf_info = {"hf_experts": hf_experts(hf, args.device), "hf_kernels": hf_kernels(hf)}
        hf_info["hf_attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        n_params = sum(p.numel() for p in hf.parameters())
        ids = prompts.to(args.device)

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

        # Too large for two copies on the GPU: HF's runs first, then the HF model goes to host memory.
        offloaded = needs_offload(hf, args.device)
        hf_runs = []
        if offloaded:
            if not args.skip_hf:
                run_hf(4)
                hf_runs = [timed(run_hf, args.device) for _ in range(args.repeats)]
            hf_info["hf_gpu_gib_left"] = offload(hf)
        engines = {label: LLMEngine(path, config, model=hf) for label, config in configs.items()}
        engine = next(iter(engines.values()))
        stops = list(range(vocab - round(args.stop_fraction * vocab), vocab))

        def run_ours(n=args.new_tokens, engine=engine):
            params = SamplingParams(
                temperature=args.temperature, max_new_tokens=n, ignore_eos=True, stop_token_ids=stops
            )
            return [o.outputs[0] for o in engine.generate(prompts.tolist(), params)]

        hf_interleaved = not (args.skip_hf or offloaded)
        if hf_interleaved:
            run_hf(4)  # warm-up: first-call allocations and kernel selection stay out of the timings
        for each in engines.values():
            run_ours(4, each)
        # Interleave the timed runs so that load changes on a shared machine hit all engines alike.
        runs = {label: ([], []) for label in engines}
        for _ in range(args.repeats):
            if hf_interleaved:
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
        update_ms = None if offloaded else update_weights_ms(engine, hf, args.device)
        pool_mb = graph_pool_mb(engine, args.batch) if args.device.startswith("cuda") else None
        step_s = (our_time - prefill_time) / max(1, args.new_tokens - 1)
        parts = decode_bytes(engine, args.batch, args.prompt_len, args.new_tokens)
        step_bytes = parts["total"]
        engine_info = {
            "cuda_graphs": engine.runner.graphs is not None,
            "engine_async": engine.async_scheduling,
            "engine_fla": engine_fla(engine),
            "engine_gdn_decode": engine_gdn_decode(engine),
            # FP8 rollouts: how many modules compute each way (scaled_mm, triton_fp8, emulated)
            "fp8_modes": fp8.modes() if (fp8 := getattr(engine.model, "fp8", None)) else None,
        }
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
        "model": args.model or args.config or f"tiny-{args.tiny or 'qwen2'}",
        "model_type": model_type,
        "params_b": round(n_params / 1e9, 3),
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
        "quantization": args.quantization,
        "tidal_tokens_per_s": round(generated / our_time, 1),
        "tidal_s": round(our_time, 3),
        "prefill_s": round(prefill_time, 4),
        "decode_step_ms": round(step_s * 1e3, 3),
        "decode_gb_per_step": round(step_bytes / 1e9, 3),
        "decode_gb": {part: round(b / 1e9, 3) for part, b in parts.items() if part != "total"},
        "roofline_fraction": round(step_bytes / step_s / (args.peak_tb_s * 1e12), 3),
        "update_weights_ms": update_ms,
        "graph_pool_mb": pool_mb,
        **engine_info,
        "hf_offloaded": offloaded,
        **hf_info,
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
