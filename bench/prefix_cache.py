"""Benchmark: prefix caching on multi-turn agent episodes, and chunked prefill under a long prompt.

Two runs, one JSON line each (both with the feature off and on, same engine settings otherwise):

- ``agent``: ``--episodes`` episodes of ``--turns`` turns. Every episode starts from one shared
  ``--system_len``-token system prompt; each turn appends a ``--user_tokens`` message, and the turn's
  prompt is the whole history (system + every earlier message and answer + the new message), as
  tidal's multi-turn agents submit it; the model answers ``--answer_tokens`` tokens (greedy,
  ``ignore_eos``), so a turn adds ``user_tokens + answer_tokens`` tokens (default 128 + 128 = 256).
  All episodes' turn t run in one ``generate`` call. Reported per mode: prompt tokens computed by
  prefills (``prefill_tokens``), tokens taken from the cache, wall time, and whether the answers agree
  with the cache-off run (``same_tokens``: fraction of answer tokens equal; bf16 may flip a near tie).
- ``chunked``: ``--decoders`` sequences decode (``--decode_prompt_len``-token prompts); once all are
  prefilled and ``--warmup_steps`` decode steps later, a ``--long_prompt``-token prompt arrives. Reported per mode: the longest
  and the median time between two tokens of the decoding sequences while the long prompt is prefilled
  (``max_inter_token_ms``: without chunking, the whole prefill stalls them), and the long prompt's time
  to first token, and the median time of the steps that advanced no decoder (``median_prefill_step_ms``:
  the long prompt's prefill, or its chunks). Chunked: ``enable_chunked_prefill`` with
  ``max_num_batched_tokens = --chunk``.

``--context_kernel both`` adds, to each benchmark, a run with the feature on and the prefill-with-context
attention forced onto the torch path (``on_torch_context``; ``attention.CONTEXT_KERNEL = False``), next
to ``on`` (the Triton kernel of ``triton_context.py`` where the engine's attention backend is triton),
and reports ``context_kernel_speedup`` (wall time, resp. the long prompt's time to first token, torch /
kernel). ``off`` turns the kernel off for every run. Each run reports ``context_kernel``: whether its
context prefills ran the kernel.

``--only kernel`` (CUDA) times one layer's prefill-with-context attention alone, the torch path and the
kernel, at the benchmarks' step shapes (the model's heads and head dim; a random paged cache): an
agent turn (``--episodes`` sequences, the last turn's new message over its history) and chunks of the
long prompt (one sequence, ``--chunk`` new tokens at half and at the full ``--long_prompt`` context).
Reports milliseconds per call of each and their largest difference.

The model is random-init with a real model's shapes (``--config``, as bench/rollout.py), or ``--model``.

    python bench/prefix_cache.py --tiny          # tiny qwen2 on CPU, < 1 minute
    python bench/prefix_cache.py --config qwen2.5-0.5b --device cuda
    python bench/prefix_cache.py --config qwen2.5-0.5b --device cuda --only chunked --chunk 1024
    python bench/prefix_cache.py --config qwen2.5-0.5b --device cuda --context_kernel both
    python bench/prefix_cache.py --config qwen2.5-0.5b --device cuda --only kernel
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _rollout_bench():
    """bench/rollout.py (its model shapes and loader), imported by path: bench/ is not a package."""
    spec = importlib.util.spec_from_file_location("bench_rollout", ROOT / "bench" / "rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF model folder")
    source.add_argument("--config", help="random-init model of this shape (bench/rollout.py's CONFIGS)")
    p.add_argument("--tiny", action="store_true", help="tiny qwen2 model and small sizes, CPU, < 1 minute")
    p.add_argument(
        "--only",
        choices=["agent", "chunked", "kernel"],
        help="run one benchmark (kernel: the context attention alone, CUDA; run only when asked)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce_eager", action="store_true")
    p.add_argument(
        "--context_kernel",
        choices=["on", "off", "both"],
        default="on",
        help="prefill-with-context attention: the Triton kernel where usable (on), the torch path (off), "
        "or an extra torch-path run of the feature-on mode (both)",
    )
    # agent
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system_len", type=int, default=1024)
    p.add_argument("--user_tokens", type=int, default=128)
    p.add_argument("--answer_tokens", type=int, default=128)
    # chunked
    p.add_argument("--decoders", type=int, default=255)
    p.add_argument("--decode_prompt_len", type=int, default=128)
    p.add_argument("--long_prompt", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--warmup_steps", type=int, default=8)
    args = p.parse_args(argv)
    if args.tiny:
        args.device = "cpu"
        args.episodes, args.turns, args.system_len, args.user_tokens, args.answer_tokens = 4, 4, 64, 16, 16
        args.decoders, args.decode_prompt_len, args.long_prompt, args.chunk = 7, 16, 480, 64
    return args


def load(args, tmp: str):
    """(hf model or None, model folder or None, vocab size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.dtype == "auto":
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    if args.model:
        return None, args.model, AutoConfig.from_pretrained(args.model).vocab_size
    if args.config:
        fields = dict(_rollout_bench().CONFIGS[args.config])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(args.seed)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        return model, None, config.vocab_size
    from tidal.testing import build_tiny_model

    path = build_tiny_model(Path(tmp) / "tiny", "qwen2", seed=args.seed, max_position_embeddings=2048)
    return None, str(path), AutoConfig.from_pretrained(str(path)).vocab_size


def modes(args, on_features: dict) -> list[tuple[str, dict, bool]]:
    """(name, engine features, context kernel on) of each run: feature off, on, and with ``--context_kernel
    both`` on again with the torch context path."""
    kernel = args.context_kernel != "off"
    runs = [("off", {}, kernel), ("on", on_features, kernel)]
    if args.context_kernel == "both":
        runs.append(("on_torch_context", on_features, False))
    return runs


def set_context_kernel(on: bool, engine) -> bool:
    """Switch the prefill-with-context kernel; whether this engine's context prefills will run it."""
    from tidal.rollout.runner import attention

    attention.CONTEXT_KERNEL = on
    if not on or engine.runner.backend != "triton":  # the triton backend implies triton is importable
        return False
    from tidal.rollout.kernels import triton_context

    return triton_context.supports(engine.runner.args.head_dim)


def make_engine(args, model, path, **features):
    from tidal.rollout import EngineConfig, LLMEngine

    config = EngineConfig(
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        max_num_seqs=max(args.episodes, args.decoders + 1),
        **features,
    )
    return LLMEngine(path, config, model=model)


def release(engine) -> None:
    """Give the engine's KV cache back before the next engine sizes its own from the free memory."""
    engine.sleep()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def agent_run(args, engine, vocab: int) -> tuple[dict, list[list[int]]]:
    """All episodes, turn by turn; returns the counters and every answer's tokens."""
    from tidal.rollout import SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    system = torch.randint(5, vocab, (args.system_len,), generator=gen).tolist()
    histories = [list(system) for _ in range(args.episodes)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.answer_tokens, ignore_eos=True)
    scheduler = engine.scheduler
    prefill0, cached0 = scheduler.num_prefill_tokens, scheduler.num_cached_tokens
    answers = []
    sync(args.device)
    start = time.perf_counter()
    for _ in range(args.turns):
        for history in histories:
            history.extend(torch.randint(5, vocab, (args.user_tokens,), generator=gen).tolist())
        outputs = engine.generate(histories, params)
        for history, out in zip(histories, outputs, strict=True):
            history.extend(out.outputs[0].token_ids)
            answers.append(out.outputs[0].token_ids)
    sync(args.device)
    stats = {
        "wall_s": round(time.perf_counter() - start, 3),
        "prefill_tokens": scheduler.num_prefill_tokens - prefill0,
        "cached_tokens": scheduler.num_cached_tokens - cached0,
    }
    return stats, answers


def warm_up(engine, vocab: int) -> None:
    """Kernels, CUDA graphs and allocator pools before the timed runs (random tokens, nothing shared)."""
    from tidal.rollout import SamplingParams

    prompts = torch.randint(5, vocab, (4, 64), generator=torch.Generator().manual_seed(12345)).tolist()
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))


def bench_agent(args, model, path, vocab: int) -> dict:
    result = {"bench": "prefix_cache_agent", "episodes": args.episodes, "turns": args.turns,
              "system_len": args.system_len, "tokens_per_turn": args.user_tokens + args.answer_tokens}  # fmt: skip
    max_len = args.system_len + args.turns * (args.user_tokens + args.answer_tokens)
    reference = None
    for name, features, kernel in modes(args, {"enable_prefix_caching": True}):
        engine = make_engine(args, model, path, **features)
        if engine.max_model_len < max_len:
            raise SystemExit(
                f"the episodes need max_model_len >= {max_len}; the model has {engine.max_model_len}"
            )
        used = set_context_kernel(kernel, engine)
        warm_up(engine, vocab)
        stats, answers = agent_run(args, engine, vocab)
        stats["context_kernel"] = used and bool(features)
        reference = reference or answers
        pairs = [(a, b) for x, y in zip(reference, answers, strict=True) for a, b in zip(x, y, strict=True)]
        stats["same_tokens"] = round(sum(a == b for a, b in pairs) / len(pairs), 4)
        result[name] = stats
        release(engine)
    result["prefill_tokens_ratio"] = round(
        result["on"]["prefill_tokens"] / result["off"]["prefill_tokens"], 4
    )
    result["speedup"] = round(result["off"]["wall_s"] / result["on"]["wall_s"], 3)
    if "on_torch_context" in result:
        result["context_kernel_speedup"] = round(
            result["on_torch_context"]["wall_s"] / result["on"]["wall_s"], 3
        )
    return result


def chunked_run(args, engine, vocab: int) -> dict:
    """Decoders running, then the long prompt arrives; step timings until every sequence decodes again."""
    from tidal.rollout import SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    budget = args.warmup_steps + 2 * (args.long_prompt // args.chunk + 1) + 8
    admission = 2 * (args.decoders * args.decode_prompt_len // args.chunk + 1)  # steps to admit them all
    short = SamplingParams(temperature=0.0, max_new_tokens=admission + budget + 8, ignore_eos=True)
    ids = [
        engine.add_request(torch.randint(5, vocab, (args.decode_prompt_len,), generator=gen).tolist(), short)
        for _ in range(args.decoders)
    ]
    scheduler = engine.scheduler
    while scheduler.waiting or scheduler.prefilling:  # every decoder prefilled and decoding
        engine.step()
    long_prompt = torch.randint(5, vocab, (args.long_prompt,), generator=gen).tolist()
    long_id, arrival, ttft, steps = None, None, None, []  # steps: (end time, decoders advanced)
    for step in range(budget):
        if step == args.warmup_steps:
            params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            long_id = engine.add_request(long_prompt, params)
            ids.append(long_id)
            arrival = time.perf_counter()
        advanced = {out.request_id for out in engine.step()}  # returns once the tokens are on the host
        now = time.perf_counter()
        steps.append((now, bool(advanced - {long_id})))
        if long_id in advanced and ttft is None:
            ttft = now - arrival
        elif ttft is not None and steps[-1][1]:
            break  # the first decode step after the long prompt's first token closes the window
    for request in ids:  # leave the engine empty
        engine.abort(request)
    # Steps that advanced no decoder after the arrival: the long prompt's prefill (or chunks of it).
    prefill_steps = [
        b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False) if not b[1] and b[0] > arrival
    ]
    decode_times = [t for t, decoded in steps if decoded]
    gaps = [b - a for a, b in zip(decode_times, decode_times[1:], strict=False) if b > arrival]
    return {
        "max_inter_token_ms": round(max(gaps) * 1e3, 2),
        "median_inter_token_ms": round(statistics.median(gaps) * 1e3, 2),
        "long_prompt_ttft_ms": round(ttft * 1e3, 2),
        "steps_in_window": sum(1 for t, _ in steps if t > arrival),
        "median_prefill_step_ms": round(statistics.median(prefill_steps) * 1e3, 2) if prefill_steps else None,
    }


def bench_chunked(args, model, path, vocab: int) -> dict:
    result = {"bench": "chunked_prefill", "decoders": args.decoders, "decode_prompt_len": args.decode_prompt_len,
              "long_prompt": args.long_prompt, "chunk": args.chunk}  # fmt: skip
    for name, features, kernel in modes(
        args, {"enable_chunked_prefill": True, "max_num_batched_tokens": args.chunk}
    ):
        engine = make_engine(args, model, path, **features)
        used = set_context_kernel(kernel, engine)
        warm_up(engine, vocab)
        if args.device.startswith("cuda"):
            chunked_run(
                args, engine, vocab
            )  # first-call costs (a 16k-token prefill's kernels) out of the timing
        result[name] = {**chunked_run(args, engine, vocab), "context_kernel": used and bool(features)}
        release(engine)
    result["max_inter_token_ratio"] = round(
        result["off"]["max_inter_token_ms"] / result["on"]["max_inter_token_ms"], 3
    )
    if "on_torch_context" in result:
        torch_run, kernel_run = result["on_torch_context"], result["on"]
        result["context_kernel_speedup"] = round(
            torch_run["long_prompt_ttft_ms"] / kernel_run["long_prompt_ttft_ms"], 3
        )
    return result


def attention_shape(args, model, path) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of the benchmarked model."""
    from transformers import AutoConfig

    config = model.config if model is not None else AutoConfig.from_pretrained(path)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, config.num_key_value_heads, head_dim


def context_step(chunks, heads, kv_heads, head_dim, block_size, dtype, device):
    """q, a paged cache (each sequence's blocks in random order) and the metadata of one prefill with
    context whose sequence b computes positions ``chunks[b] = (start, end)``."""
    from tidal.rollout.runner.attention import AttentionMetadata

    widths = [-(-end // block_size) for _, end in chunks]
    perm = torch.randperm(sum(widths), device=device)
    tables = torch.zeros(len(chunks), max(widths), dtype=torch.int64, device=device)
    used = 0
    for row, width in enumerate(widths):
        tables[row, :width] = perm[used : used + width]
        used += width
    cache = torch.randn(2, sum(widths), block_size, kv_heads, head_dim, device=device).to(dtype)
    lens = torch.tensor([end - start for start, end in chunks], device=device)
    q = torch.randn(int(lens.sum()), heads, head_dim, device=device).to(dtype)
    firsts = torch.cumsum(lens, 0) - lens
    cols = torch.arange(int(lens.max()), device=device)
    valid = cols[None, :] < lens[:, None]
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64, device=device),
        kv_cache=cache[None],
        pad_index=torch.where(valid, firsts[:, None] + cols[None, :], 0),
        pad_valid=valid,
        block_tables=tables,
        context_lens=torch.tensor([end for _, end in chunks], device=device),
        query_starts=torch.tensor([start for start, _ in chunks], device=device),
        backend="triton",
    )
    return q, cache, meta


def time_call(fn, *inputs, repeats: int = 20) -> float:
    """Milliseconds per ``fn(*inputs)`` (CUDA events, after three warm-up calls)."""
    for _ in range(3):
        fn(*inputs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(*inputs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def bench_kernel(args, model, path, vocab: int) -> dict:
    from tidal.rollout.runner import attention

    if not args.device.startswith("cuda"):
        raise SystemExit("--only kernel times the Triton kernel: it needs --device cuda")
    heads, kv_heads, head_dim = attention_shape(args, model, path)
    dtype = next(model.parameters()).dtype if model is not None else torch.bfloat16
    last = args.system_len + (args.turns - 1) * (args.user_tokens + args.answer_tokens)
    shapes = {
        "agent_last_turn": [(last, last + args.user_tokens)] * args.episodes,
        "chunk_mid": [(args.long_prompt // 2 - args.chunk, args.long_prompt // 2)],
        "chunk_last": [(args.long_prompt - args.chunk, args.long_prompt)],
    }
    result = {"bench": "context_attention_kernel", "heads": heads, "kv_heads": kv_heads,
              "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
    for name, chunks in shapes.items():
        q, cache, meta = context_step(chunks, heads, kv_heads, head_dim, 16, dtype, args.device)
        inputs = (q, cache, meta, None, head_dim**-0.5)
        kernel = attention.context_prefill_attention(*inputs)
        # The torch path's mask is built once per step (cached in the metadata for every layer), as here.
        torch_out = attention.torch_context_prefill_attention(*inputs)
        torch_ms = time_call(attention.torch_context_prefill_attention, *inputs)
        kernel_ms = time_call(attention.context_prefill_attention, *inputs)
        result[name] = {
            "seqs": len(chunks),
            "new_tokens": chunks[0][1] - chunks[0][0],
            "context": chunks[0][1],
            "torch_ms": round(torch_ms, 4),
            "kernel_ms": round(kernel_ms, 4),
            "speedup": round(torch_ms / kernel_ms, 2),
            "max_abs_diff": (kernel.float() - torch_out.float()).abs().max().item(),
        }
    return result


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model, path, vocab = load(args, tmp)
        env = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "model": args.model or args.config or "tiny-qwen2"}  # fmt: skip
        from tidal.rollout.runner import attention

        try:
            for name, bench in (("agent", bench_agent), ("chunked", bench_chunked), ("kernel", bench_kernel)):
                if args.only == name or (args.only is None and name != "kernel"):
                    result = {**bench(args, model, path, vocab), **env}
                    print(json.dumps(result), flush=True)
                    results.append(result)
        finally:
            attention.CONTEXT_KERNEL = True  # the engine's default, for a caller in the same process
    return results


if __name__ == "__main__":
    main()
