"""Benchmark: MoE decode, tidal's engine (fused Triton experts and the unfused path) vs ``transformers.generate``.

The model is random-init from a config object (no checkpoint download): ``qwen3-30b-a3b`` has
Qwen3-30B-A3B's shapes (hidden 2048, 48 layers, 32 query / 4 KV heads of 128, 128 experts, top-8,
``moe_intermediate_size`` 768, vocab 151936; ~30.5B parameters, ~61 GB in bf16). With HF's random init
(std 0.02) the router logits are near zero, so the top-8 choice is close to uniform: a balanced load.

One run, one set of weights:

1. ``transformers.generate`` on the model (greedy, ``min_new_tokens``) at ``--hf_batch`` sequences and
   ``--hf_new_tokens`` new tokens (fewer than ours: HF's per-token cost grows with the context, so this
   flatters HF). transformers' default experts kernel in ``generate`` is ``batched_mm`` (it copies each
   token's 8 experts' weights: the 8192-token prefill of B=64 would need ~400 GB); when it runs out of
   memory the error goes into the JSON and the reference is retried with ``grouped_mm`` kept for the
   whole ``generate`` (a registered alias, so generate does not swap it), the fastest HF path that fits;
2. the HF model moves to host memory and tidal's ``LLMEngine`` copies its weights (``model=``);
3. per ``--batches`` entry and per mode (``fused``: ``moe.FUSED_MOE`` on, ``unfused``: off; the decode
   CUDA graphs are recaptured after each switch), one warm-up then a timed run of ``--new_tokens``
   tokens (``ignore_eos``) and a prefill-only run: tokens/s = batch x new tokens / time, and
   ``decode_step_ms`` = (full - prefill-only) / (new tokens - 1).

Prints progress on stderr and one JSON line on stdout.

    python bench/moe.py --tiny                    # toy MoE on CPU (no fused path there), < 1 minute
    python bench/moe.py --batches 64 256 --prompt_len 128 --new_tokens 256 --hf_batch 64 --hf_new_tokens 32
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

# Random-init MoE shapes (Qwen3-MoE configs). bench/rl_step.py trains the smaller ones.
MOE_CONFIGS = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, tie_word_embeddings=False, norm_topk_prob=True,
    ),
    # ~2.2B total, ~0.65B active: 16 experts, top-2; trains (fp32 master weights + Adam) on one GPU.
    "qwen3-moe-2b": dict(
        hidden_size=1536, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        intermediate_size=4096, moe_intermediate_size=1024, num_experts=16, num_experts_per_tok=2,
        vocab_size=151936, tie_word_embeddings=True, norm_topk_prob=True,
    ),
    "tiny-moe": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        vocab_size=1024, tie_word_embeddings=False, norm_topk_prob=True,
    ),
}  # fmt: skip
MOE_COMMON = dict(rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)  # fmt: skip
# ``generate`` swaps grouped_mm for batched_mm; under this name it keeps the grouped GEMM throughout.
HF_GROUPED_ALIAS = "grouped_mm_throughout"


def moe_config(name: str):
    """The transformers config object of a ``MOE_CONFIGS`` shape."""
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe", **MOE_COMMON, **MOE_CONFIGS[name])


def log(message: str) -> None:
    print(f"[bench/moe {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-30b-a3b", choices=sorted(MOE_CONFIGS))
    p.add_argument("--tiny", action="store_true", help="tiny-moe on CPU at toy sizes (checks the script)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--hf_batch", type=int, default=64, help="0: no transformers reference")
    p.add_argument("--hf_new_tokens", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=["fused", "unfused"], choices=["fused", "unfused"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        args.config, args.device = "tiny-moe", "cpu"
        args.batches, args.prompt_len, args.new_tokens = [4, 8], 8, 8
        args.hf_batch, args.hf_new_tokens = min(args.hf_batch, 4), 4
    return args


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def build_hf(name: str, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(moe_config(name), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def keep_grouped_mm(hf) -> str | None:
    """Register grouped_mm under another name and select it (``generate`` swaps only "grouped_mm" for
    batched_mm); the error in words where this transformers cannot."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

        ALL_EXPERTS_FUNCTIONS.register(HF_GROUPED_ALIAS, grouped_mm_experts_forward)
        hf.set_experts_implementation(HF_GROUPED_ALIAS)
    except (ImportError, AttributeError, KeyError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def hf_reference(hf, prompts: torch.Tensor, new_tokens: int, device: torch.device) -> dict:
    """tokens/s of ``hf.generate`` with transformers' default experts kernel, then (if that runs out of
    memory) with grouped_mm kept throughout; each failed attempt's error is reported."""
    ids = prompts.to(device)
    original = getattr(hf.config, "_experts_implementation", None)
    default = "batched_mm in generate" if device.type == "cuda" and original == "grouped_mm" else original
    result: dict = {"batch": len(prompts), "new_tokens": new_tokens, "errors": {}}

    def run(n=new_tokens):
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, top_k=None, top_p=None,
                temperature=None, max_new_tokens=n, min_new_tokens=n,
            )  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    for attempt in ("default", HF_GROUPED_ALIAS):
        label = f"default ({default})" if attempt == "default" else attempt
        if attempt != "default" and (problem := keep_grouped_mm(hf)):
            result["errors"][label] = problem
            break
        log(f"transformers.generate, experts {label}: B={len(prompts)}, {new_tokens} new tokens")
        try:
            run(2)  # warm-up
            seconds, tokens = timed(run, device)
        except torch.OutOfMemoryError as err:
            result["errors"][label] = "OutOfMemoryError: " + str(err).splitlines()[0][:200]
            log(f"  out of memory ({label})")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        rate = round(len(prompts) * new_tokens / seconds, 1)
        result.update(experts=label, s=round(seconds, 3), tokens_per_s=rate, tokens=tokens)
        break
    if original is not None and getattr(hf.config, "_experts_implementation", None) != original:
        hf.set_experts_implementation(original)
    return result


def engine_runs(engine, prompts: list[list[int]], args, device: torch.device) -> dict:
    """Per batch and mode: tokens/s of a full run, prefill-only time and decode step time."""
    from tidal.rollout import SamplingParams
    from tidal.rollout.models import moe

    results: dict = {}
    for batch in args.batches:
        rows = prompts[:batch]
        per_batch: dict = {}
        outputs = {}
        for mode in args.modes:
            moe.FUSED_MOE = mode == "fused"
            if engine.runner.graphs is not None:  # recapture the decode graphs with this path
                engine.runner.graphs.clear()
                torch.cuda.empty_cache()

            def run(n, rows=rows):
                params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
                return [o.outputs[0].token_ids for o in engine.generate(rows, params)]

            log(f"engine {mode}: B={batch}, {args.new_tokens} new tokens")
            run(4)  # warm-up: captures the graph of this batch's bucket
            seconds, outputs[mode] = timed(lambda: run(args.new_tokens), device)
            prefill, _ = timed(lambda: run(1), device)
            per_batch[mode] = {
                "tokens_per_s": round(batch * args.new_tokens / seconds, 1),
                "s": round(seconds, 3),
                "prefill_s": round(prefill, 4),
                "decode_step_ms": round((seconds - prefill) / max(1, args.new_tokens - 1) * 1e3, 3),
            }
        if {"fused", "unfused"} <= per_batch.keys():
            per_batch["fused_speedup"] = round(
                per_batch["fused"]["tokens_per_s"] / per_batch["unfused"]["tokens_per_s"], 3
            )
            # bf16 roundings differ between the paths: greedy tokens agree for a while, then may part.
            same = [a[:16] == b[:16] for a, b in zip(outputs["fused"], outputs["unfused"], strict=True)]
            per_batch["first16_match_fused_unfused"] = round(sum(same) / batch, 3)
        per_batch["tokens"] = outputs[args.modes[0]]
        results[str(batch)] = per_batch
    moe.FUSED_MOE = True
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tidal.accel import triton_available
    from tidal.rollout import EngineConfig, LLMEngine

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    log(f"building random-init {args.config} on {device} ({dtype})")
    hf = build_hf(args.config, device, dtype, args.seed)
    params = sum(p.numel() for p in hf.parameters())
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(5, min(vocab, 100_000), (max(args.batches), args.prompt_len), generator=gen)
    result: dict = {
        "bench": "moe", "model": args.config, "params_b": round(params / 1e9, 2), "device": args.device,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "fused_available": device.type == "cuda" and triton_available(),
    }  # fmt: skip
    hf_result = None
    if args.hf_batch:
        hf_result = hf_reference(hf, prompts[: args.hf_batch], args.hf_new_tokens, device)
    if device.type == "cuda":
        log("moving the HF model to host memory (the engine copies its weights from there)")
        hf.to("cpu")
        gc.collect()
        torch.cuda.empty_cache()
    config = EngineConfig(
        max_num_seqs=max(args.batches), max_model_len=args.prompt_len + args.new_tokens,
        dtype=result["dtype"], device=args.device, seed=args.seed,
    )  # fmt: skip
    log("building the engine")
    engine = LLMEngine(config=config, model=hf)
    del hf
    gc.collect()
    runs = engine_runs(engine, prompts.tolist(), args, device)
    if hf_result is not None and "tokens_per_s" in hf_result:
        hf_tokens = hf_result.pop("tokens")
        for mode in args.modes:
            if str(args.hf_batch) in runs:
                ours = runs[str(args.hf_batch)][mode]["tokens_per_s"]
                hf_result[f"ratio_{mode}"] = round(ours / hf_result["tokens_per_s"], 2)
        if str(args.hf_batch) in runs:
            ours = runs[str(args.hf_batch)]["tokens"]
            n = min(4, args.hf_new_tokens)
            hf_result["first4_match"] = round(
                sum(a[:n] == b[:n] for a, b in zip(ours, hf_tokens, strict=True)) / len(ours), 3
            )
    for per_batch in runs.values():
        per_batch.pop("tokens")
    result.update(engine=runs, hf=hf_result)
    if device.type == "cuda":
        result["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    result.update(torch=torch.__version__, machine=platform.machine())
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
