"""Benchmark: tidal's rollout engine vs ``transformers.generate`` on the same prompts, in one run.

Greedy decoding, every sample runs exactly ``--new_tokens`` tokens (our engine: ``ignore_eos``; HF:
``min_new_tokens``). Prints one JSON line with generated tokens/s of both and the ratio (ours / HF).

    python bench/rollout.py                                    # tiny qwen2 model on CPU, < 1 minute
    python bench/rollout.py --batch 16 --prompt_len 32 --new_tokens 64 --threads 1 --repeats 3
    python bench/rollout.py --config qwen2.5-0.5b --device cuda --batch 256 --prompt_len 128 --new_tokens 256
    python bench/rollout.py --model path/to/hf_folder --device cuda --dtype bfloat16
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf, path = load_hf_model(args, dtype, tmp)
        vocab = hf.config.vocab_size
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(5, min(vocab, 100_000), (args.batch, args.prompt_len), generator=gen)
        config = EngineConfig(
            max_num_seqs=args.batch,
            max_model_len=args.prompt_len + args.new_tokens,
            dtype=str(dtype).removeprefix("torch."),
            device=args.device,
            seed=args.seed,
        )
        engine = LLMEngine(path, config, model=hf)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        ids = prompts.to(args.device)

        def run_hf(n=args.new_tokens):
            with torch.inference_mode():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                )
            return out[:, args.prompt_len :].tolist()

        def run_ours():
            return [o.outputs[0].token_ids for o in engine.generate(prompts.tolist(), params)]

        run_hf(4)  # warm-up: first-call allocations and kernel selection stay out of the timings
        engine.generate(prompts.tolist(), SamplingParams(temperature=0.0, max_new_tokens=4))
        # Interleave the timed runs so that load changes on a shared machine hit both engines alike.
        hf_runs, our_runs = [], []
        for _ in range(args.repeats):
            hf_runs.append(timed(run_hf, args.device))
            our_runs.append(timed(run_ours, args.device))
        (hf_time, hf_out), (our_time, our_out) = (
            min(runs, key=lambda r: r[0]) for runs in (hf_runs, our_runs)
        )
    generated = args.batch * args.new_tokens
    result = {
        "bench": "rollout",
        "model": args.model or args.config or "tiny-qwen2",
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "tidal_tokens_per_s": round(generated / our_time, 1),
        "hf_tokens_per_s": round(generated / hf_time, 1),
        "ratio": round(hf_time / our_time, 3),
        "greedy_match": round(sum(a == b for a, b in zip(our_out, hf_out, strict=True)) / args.batch, 3),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
