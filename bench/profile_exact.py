"""Profile: where ``--exact_logprobs`` spends its extra time (issue #34), default vs exact, kernel by kernel.

Two parts, each run once with tidal's default ops and once with the batch-invariant ones
(``tidal.rollout.batch_invariant``), on a random-init model of ``--config`` (``bench/train_step.py``'s
shapes; bf16 on CUDA, float32 on the CPU):

(a) engine decode: an ``LLMEngine`` (``EngineConfig(exact_logprobs=...)``) prefills ``--batch`` prompts of
    ``--prompt_len`` tokens, warms up (CUDA graph capture, Triton compilation), then ``--steps`` decode
    steps are timed (ms per step) and ``--steps`` more run under ``torch.profiler``; also whether the
    engine replayed CUDA graphs;
(b) the trainer's log-prob forward (``tidal.models.forward.token_logprobs``) on one packed row of
    ``--tokens`` tokens (samples of ``--sample_len``), gradient checkpointing on as the CLI's GRPO runs:
    forward only (no grad) and forward + backward of the summed log-probs; the exact model is the same
    model after ``batch_invariant.make_exact`` (its grad-enabled call is the straight-through splice: an
    exact no-grad forward for the values plus a default forward for the gradient).

For every measurement: ms, and the ``--top`` CUDA kernels by total time (CPU: ``aten::`` ops by self time)
with calls and share of the profiled total. Prints ONE JSON line; writes a readable table to ``--out``.

    PYTHONPATH=$PWD python3 bench/profile_exact.py --device cuda --config qwen2.5-0.5b
    PYTHONPATH=$PWD python3 bench/profile_exact.py --device cpu --config tiny       # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_decode import start_batch  # noqa: E402
from train_step import CONFIGS, make_model, model_config, sync  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batch", type=int, default=256, help="decode rows")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed (and as many profiled)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the trainer's packed row")
    p.add_argument("--sample_len", type=int, default=320, help="tokens per sample in the packed row")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions of each trainer measurement")
    p.add_argument("--top", type=int, default=15, help="kernels listed per measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="profile_exact.txt", help="the readable table")
    args = p.parse_args(argv)
    if args.device == "cpu" and args.config == "tiny":  # a smoke test's shapes
        args.batch, args.prompt_len, args.steps, args.tokens, args.sample_len = 8, 16, 8, 512, 64
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    if args.sample_len < 2 or args.tokens < args.sample_len:
        p.error("--sample_len must be at least 2 and --tokens at least --sample_len")
    return args


def dtype_of(device: str) -> torch.dtype:  # the RL engine's and exact mode's compute dtype
    return torch.bfloat16 if device == "cuda" else torch.float32


def kernel_table(prof, on_gpu: bool, top: int) -> tuple[float, list[dict]]:
    """(total ms of every kernel, the ``top`` kernels by total time: name, calls, ms, share)."""
    calls, total = defaultdict(int), defaultdict(float)
    cpu = torch.autograd.DeviceType.CPU
    for event in prof.events():
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            us = event.device_time
        elif not on_gpu and event.device_type == cpu and event.name.startswith("aten::"):
            us = event.self_cpu_time_total  # the CPU has no kernels: its ops' own time
        else:
            continue
        calls[event.name] += 1
        total[event.name] += us / 1e3
    whole = sum(total.values())
    ranked = sorted(total, key=total.get, reverse=True)[:top]
    rows = [
        {"name": n[:120], "calls": calls[n], "ms": round(total[n], 3), "share": round(total[n] / whole, 4)}
        for n in ranked
    ]
    return round(whole, 3), rows


def profiled(fn, device: str, top: int) -> tuple[float, list[dict]]:
    """Run ``fn`` once under ``torch.profiler`` (CUDA kernels, or CPU ops on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync(torch.device(device))
    with profile(activities=activities) as prof:
        fn()
        sync(torch.device(device))
    return kernel_table(prof, on_gpu, top)


def decode(args, exact: bool) -> dict:
    """Part (a): one engine, default or exact; ms per decode step and its kernels."""
    from tidal.rollout import EngineConfig, LLMEngine

    dtype = dtype_of(args.device)
    hf = make_model(args.config, torch.device(args.device), seed=args.seed).to(dtype).eval()
    config = EngineConfig(
        max_num_seqs=args.batch,
        # at least the CLI's 64 + 256 (issue #34): exact attention gathers the block table's whole width
        max_model_len=args.prompt_len + max(256, 3 * args.steps + 8),
        dtype=str(dtype).removeprefix("torch."),
        device=args.device,
        seed=args.seed,
        gpu_memory_utilization=0.1,  # a few hundred MB of KV is plenty; a big zeroed cache only costs time
        exact_logprobs=exact,
    )
    engine = LLMEngine(None, config, model=hf)
    del hf
    ns = argparse.Namespace(batch=args.batch, prompt_len=args.prompt_len, steps=args.steps,
                            temperature=1.0, seed=args.seed)  # fmt: skip
    start_batch(engine, ns, model_config(args.config).vocab_size)
    for _ in range(4):  # warm-up: graph capture, Triton compilation
        engine.step()
    device = torch.device(args.device)
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync(device)
    step_ms = (time.perf_counter() - start) / args.steps * 1e3

    def steps(step=engine.step):
        for _ in range(args.steps):
            step()

    busy, top = profiled(steps, args.device, args.top)
    graphs = engine.runner.graphs
    result = {
        "step_ms": round(step_ms, 4),
        "kernel_ms_per_step": round(busy / args.steps, 4),
        "cuda_graphs": bool(graphs is not None and graphs.graphs),
        "async_scheduling": bool(engine.async_scheduling),
        "top": top,
    }
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def packed_batch(args, vocab: int, device: str) -> dict:
    """One packed row of ``--tokens`` tokens: samples of ``--sample_len`` (the last one shorter)."""
    lens = [args.sample_len] * (args.tokens // args.sample_len)
    if args.tokens % args.sample_len >= 2:
        lens.append(args.tokens % args.sample_len)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(5, vocab, (1, sum(lens)), generator=gen)
    lens_t = torch.tensor(lens)
    batch = dict(input_ids=ids, position_ids=torch.cat([torch.arange(n) for n in lens])[None], seq_lens=lens_t,
                 segment_ids=torch.repeat_interleave(torch.arange(len(lens)), lens_t)[None],
                 cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lens_t.cumsum(0)]).to(torch.int32))  # fmt: skip
    return {k: v.to(device) for k, v in batch.items()}


def trainer_step(model, batch: dict, backward: bool):
    from tidal.models.forward import token_logprobs

    def run():
        if backward:
            lp, _ = token_logprobs(model, batch)
            lp.float().sum().backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                token_logprobs(model, batch)

    return run


def timed(fn, device: str, reps: int) -> float:
    fn()  # warm-up: Triton compilation, allocator
    sync(torch.device(device))
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(torch.device(device))
    return (time.perf_counter() - start) / reps * 1e3


def trainer(args) -> dict:
    """Part (b): the default model first, then the same model switched by ``make_exact`` (in place)."""
    from tidal.rollout.batch_invariant import make_exact

    model = make_model(args.config, torch.device(args.device), gradient_checkpointing=True, seed=args.seed)
    model = model.to(dtype_of(args.device)).train()
    batch = packed_batch(args, model.config.vocab_size, args.device)
    results = {}
    for mode in ("default", "exact"):
        if mode == "exact":
            make_exact(model)
        for kind, backward in (("forward", False), ("forward_backward", True)):
            fn = trainer_step(model, batch, backward)
            ms = timed(fn, args.device, args.reps)
            busy, top = profiled(fn, args.device, args.top)
            results[f"{mode}/{kind}"] = {"ms": round(ms, 3), "kernel_ms": busy, "top": top}
    results["tokens"] = int(batch["input_ids"].shape[1])
    return results


def table(report: dict) -> str:
    """The report as text: a header per measurement, then its kernels."""
    lines = [f"profile_exact: config={report['config']} device={report['device']} gpu={report['gpu']}", ""]
    sections = [(f"decode/{m}", report["decode"][m]) for m in ("default", "exact")]
    sections += [(f"trainer/{k}", v) for k, v in report["trainer"].items() if isinstance(v, dict)]
    for name, entry in sections:
        stats = {k: v for k, v in entry.items() if k != "top"}
        lines.append(f"== {name}: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
        lines.append(f"{'total ms':>10} {'calls':>7} {'share':>6}  kernel")
        for row in entry["top"]:
            lines.append(f"{row['ms']:10.3f} {row['calls']:7d} {row['share']:6.1%}  {row['name']}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    decode_results = {mode: decode(args, mode == "exact") for mode in ("default", "exact")}
    decode_results["ratio"] = round(
        decode_results["exact"]["step_ms"] / decode_results["default"]["step_ms"], 3
    )
    train_results = trainer(args)
    for kind in ("forward", "forward_backward"):
        ratio = train_results[f"exact/{kind}"]["ms"] / train_results[f"default/{kind}"]["ms"]
        train_results[f"ratio/{kind}"] = round(ratio, 3)
    report = {
        "bench": "profile_exact", "config": args.config, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
        "batch": args.batch, "prompt_len": args.prompt_len, "steps": args.steps,
        "decode": decode_results, "trainer": train_results, "wall_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    Path(args.out).write_text(table(report))
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
