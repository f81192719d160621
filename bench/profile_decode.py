"""Profile: where one decode step of tidal's rollout engine spends its time (issue #18's "profile first").

Builds the engine on a random-init model (``bench/rollout.py``'s shapes), prefills ``--batch`` prompts,
then runs ``--steps`` decode steps through ``LLMEngine.step`` twice:

1. timed with host clocks: the wall time of each step, and inside it the host-only phases — the
   scheduler (``schedule`` + ``postprocess``), the engine's bookkeeping (snapshots of the outputs), and
   ``ModelRunner.run`` (which builds the decode inputs, enqueues the forward and sampling, then blocks
   on the one device-to-host copy of the sampled ids): ``SYNC_PHASES``; with async scheduling (the CUDA
   default, ``--async_scheduling``) ``ASYNC_PHASES`` instead, as the engine then launches each step ahead
   rather than through ``run``. Every phase of the table is printed (0 where a step did not call it);
2. under ``torch.profiler``: every GPU kernel's time, grouped by what it does (GEMMs, attention, norms,
   rotary, sampling and log-softmax, element-wise and copies), so that ``gpu_busy_ms`` — the sum of kernel
   time per step — can be set against the wall time: the difference is time the GPU waits for the host.

Prints one JSON line (milliseconds per step) and, on stderr, the top kernels. ``--tp_size N``: a
tensor-parallel engine; the profile is rank 0's (its NCCL kernels are ``collective``, and include the
time they wait for the other ranks).

    python bench/profile_decode.py --config qwen2.5-0.5b --batch 256 --prompt_len 128 --steps 64
    python bench/profile_decode.py   # tiny model on the CPU (plumbing check; CPU "kernels" are ops)

``--fused_kernels both`` measures the decoder with and without the fused Triton kernels (SwiGLU; RoPE +
q/k norm + KV store: ``tidal/rollout/models/triton_fused.py``) in one run, one engine each, and prints a
JSON line for each (``"fused_kernels": true/false``). ``--cuda_rope both`` likewise, with an FP8 cache:
RoPE and the KV store inside the CUDA decode kernel, or ``rope_store_kv``'s launch before it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Kernel name → category, first match wins (names of cuBLAS/CUTLASS, Triton and ATen kernels).
CATEGORIES = [
    ("collective", r"nccl|allreduce|all_reduce|allgather|all_gather|broadcast"),  # tensor parallelism
    # attention first: flash attention's kernel names carry cutlass types
    ("attention", r"attention|attn|paged|flash"),
    ("gemm", r"gemm|cutlass|nvjet|sm90_xmma|ampere_|cublas|splitk|matmul|^aten::(add)?mm$|bmm"),
    ("norm", r"norm"),
    ("rotary", r"rope|rotary"),
    ("sampling", r"sample|softmax|gumbel|argmax|topk|sort|logprob|exponential|log_softmax|max_"),
    ("copy", r"copy|memcpy|memset|fill|cat|index|gather|scatter"),
    ("elementwise", r"elementwise|vectorized|reduce|silu|mul|add"),
]


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, low)), "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser(__doc__)
    p.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    on_off_both(
        p,
        "--fused_kernels",
        "the decoder's fused Triton kernels (layers.FUSED_KERNELS; CUDA only): on, off, or each in turn",
    )
    on_off_both(
        p,
        "--cuda_rope",
        "FP8 cache: the CUDA decode kernel rotates and stores the step's keys and values itself "
        "(triton_attention.FP8_CUDA_ROPE), or rope_store_kv's launch does it first; both: each in turn",
    )
    p.add_argument(
        "--final_only",
        action="store_true",
        help="step(snapshot=...) declines every unfinished request (a non-streaming server's engine loop)",
    )
    return p.parse_args(argv)


SETTINGS = {"on": [True], "off": [False], "both": [True, False]}  # an on/off/both option's values


def on_off_both(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An option measured on, off, or each in turn (``SETTINGS`` maps its value to the runs)."""
    p.add_argument(flag, choices=tuple(SETTINGS), default="on", help=help)


def build_parser(description: str) -> argparse.ArgumentParser:
    """The engine and model options shared with ``bench/profile_prefill.py`` (each adds its own)."""
    from bench.moe import MOE_CONFIGS
    from bench.rollout import CONFIGS

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config",
        choices=sorted([*CONFIGS, *MOE_CONFIGS]),
        help="random-init model of this shape, dense (bench/rollout.py) or MoE (bench/moe.py); default: tiny",
    )
    p.add_argument(
        "--layers", type=int, default=0, help="keep only this many decoder layers (0: the shape's own)"
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--enforce_eager", action="store_true")
    p.add_argument(
        "--tp_size", type=int, default=1, help="tensor-parallel engine over this many GPUs (rank 0's kernels)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=15, help="kernels listed on stderr")
    p.add_argument(
        "--async_scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="the engine's async scheduling (auto: its default, on for CUDA); the host phases differ",
    )
    p.add_argument(
        "--quantization",
        default="none",
        choices=("none", "fp8"),
        help="the engine's rollout weights (--rollout_quantization): model dtype or FP8 (per-channel scales)",
    )
    p.add_argument(
        "--kv_cache_dtype",
        default="auto",
        choices=("auto", "fp8"),
        help="the engine's KV cache (--rollout_kv_cache_dtype): model dtype or FP8 (a scale per row)",
    )
    return p


class PhaseClock:
    """Accumulates host time of wrapped methods by phase name."""

    def __init__(self):
        self.total = defaultdict(float)

    def wrap(self, obj, method: str, phase: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[phase] += time.perf_counter() - start

        setattr(obj, method, timed)


# A host phase: ``(where, method, phase)``, the method ``method`` of the engine's ``scheduler`` or ``runner``
# (or of a class named by its module path, clocked on the class since a step makes new instances), whose
# time adds to ``phase``.
SCHEDULER_PHASES = (  # clocked alike in both engines
    ("scheduler", "schedule", "schedule"),
    ("scheduler", "postprocess", "postprocess"),
)
SYNC_PHASES = (  # an engine that runs each step through ``ModelRunner.run``
    *SCHEDULER_PHASES,
    ("runner", "run", "runner_run"),
    ("runner", "_decode_step", "runner_decode_inputs"),
    ("runner", "forward_step", "runner_forward_enqueue"),
    ("runner", "sampler", "runner_sampler_enqueue"),
)
HOST_PHASES = (  # the host-only methods of an engine that launches steps ahead (bench/profile_host.py)
    *SCHEDULER_PHASES,
    ("scheduler", "plan_ahead", "plan_ahead"),
    ("scheduler", "release_ahead", "plan_ahead"),
    ("tidal.rollout.scheduling.scheduler.Lookahead", "matches", "matches"),
    ("runner", "_decode_step", "decode_inputs"),
    ("runner", "_sampling_tensors", "sampling_tensors"),
    ("tidal.rollout.runner.steps.LaunchedStep", "result", "result"),
)
ASYNC_PHASES = (*HOST_PHASES, ("runner", "launch", "launch"), ("runner", "launch_ahead", "launch_ahead"))


def phase_owner(engine, where: str):
    """The object whose method a phase clocks: the engine's scheduler or runner, or a class by its path."""
    if where in ("scheduler", "runner"):
        return getattr(engine, where)
    module, _, name = where.rpartition(".")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def clocked(engine, table) -> Iterator[PhaseClock]:
    """A ``PhaseClock`` over the methods of ``table`` (host phases) for the block; they are put back after."""
    clock, saved, unset = PhaseClock(), [], object()
    for where, method, phase in table:
        owner = phase_owner(engine, where)
        saved.append((owner, method, vars(owner).get(method, unset)))
        clock.wrap(owner, method, phase)
    try:
        yield clock
    finally:
        for owner, method, original in reversed(saved):
            if original is unset:  # not its own attribute before: drop the copy (the inherited one shows)
                delattr(owner, method)
            else:
                setattr(owner, method, original)


def phase_ms(clock: PhaseClock, table, steps: int) -> dict:
    """Milliseconds per step of each phase of ``table``, in its order (0 where no step called it)."""
    phases = dict.fromkeys(phase for _, _, phase in table)
    return {phase: round(clock.total.get(phase, 0.0) / steps * 1e3, 4) for phase in phases}


def load_model(args, dtype: torch.dtype, tmp: str):
    """(HF model, its folder or None): a random-init dense or MoE shape, ``--layers`` of them if set."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.moe import MOE_CONFIGS, moe_config
    from bench.rollout import CONFIGS, load_hf_model

    if args.config in MOE_CONFIGS:
        config = moe_config(args.config)
    elif args.config:
        fields = dict(CONFIGS[args.config])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        ns = argparse.Namespace(model=None, config=None, tiny=None, device=args.device, seed=args.seed)
        return load_hf_model(ns, dtype, tmp)
    if args.layers:
        config.num_hidden_layers = args.layers
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), None


def build_engine(args, tmp: str, **overrides):
    """The engine of ``args`` (``overrides``: more ``EngineConfig`` fields) and the model's vocabulary size."""
    from tidal.rollout import EngineConfig, LLMEngine

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hf, path = load_model(args, dtype, tmp)
    config = EngineConfig(
        max_num_seqs=args.batch,
        max_model_len=args.prompt_len + 3 * args.steps + 8,
        dtype=str(dtype).removeprefix("torch."),
        device=args.device,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        tp_size=args.tp_size,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **overrides,
    )
    return LLMEngine(path, config, model=hf), hf.config.vocab_size


def start_batch(engine, args, vocab: int) -> None:
    """Queue ``batch`` prompts that decode long enough for every measurement, and prefill them."""
    from tidal.rollout import SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(5, min(vocab, 100_000), (args.batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=args.temperature, max_new_tokens=3 * args.steps + 4, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    while any(not s.num_output_tokens for s in _seqs(engine)):
        engine.step()  # prefills (the scheduler may need several)


def _seqs(engine):
    return list(engine.scheduler.running) + [s for g in engine.scheduler.waiting for s in g]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_kwargs(args) -> dict:
    return {"snapshot": lambda request_id: False} if args.final_only else {}


def timed_steps(engine, args, table) -> dict:
    """``--steps`` engine steps with the phases of ``table`` clocked: ms per step of each, and ``step_wall``."""
    with clocked(engine, table) as clock:
        sync(args.device)
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step(**step_kwargs(args))
        sync(args.device)
        wall = time.perf_counter() - start
    return phase_ms(clock, table, args.steps) | {"step_wall": round(wall / args.steps * 1e3, 4)}


def host_phases(engine, args) -> dict:
    """The host phases of ``--steps`` decode steps (ms per step), with what they leave over.

    Synchronous engine: ``engine_bookkeeping`` is the step's wall time outside the scheduler and
    ``run``; ``runner_wait_for_gpu`` is ``run`` less its enqueueing. Async scheduling: ``launch_ahead``
    (staging step t+1's inputs, enqueueing its forward and sampling while the device runs step t) includes
    ``decode_inputs`` and ``sampling_tensors``; ``result`` is the wait for a step's ids and reading them;
    ``host_busy`` is the step's wall time less that wait: what the device's step time must cover."""
    if engine.async_scheduling:
        ms = timed_steps(engine, args, ASYNC_PHASES)
        ms["host_busy"] = round(ms["step_wall"] - ms["result"], 4)
        return ms
    ms = timed_steps(engine, args, SYNC_PHASES)
    ms["engine_bookkeeping"] = round(
        ms["step_wall"] - ms["schedule"] - ms["postprocess"] - ms["runner_run"], 4
    )
    enqueue = ms["runner_decode_inputs"] + ms["runner_forward_enqueue"] + ms["runner_sampler_enqueue"]
    ms["runner_wait_for_gpu"] = round(ms["runner_run"] - enqueue, 4)
    return ms


def kernel_profile(engine, args, run=None, steps: int | None = None) -> tuple[dict, list, float]:
    """Every kernel's time (ms per step) over ``run()`` (default: ``--steps`` engine steps), grouped by
    ``category``; the top ``--top`` kernels; the kernel time per step. ``steps``: what ``run`` takes."""
    from torch.profiler import ProfilerActivity, profile

    if run is None:
        steps = args.steps

        def run():
            for _ in range(args.steps):
                engine.step(**step_kwargs(args))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    sync(args.device)
    with profile(activities=activities) as prof:
        run()
        sync(args.device)
    on_gpu = args.device.startswith("cuda")
    per_kernel = defaultdict(float)
    for event in prof.events():
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / 1e3  # us → ms
        elif (
            not on_gpu
            and event.device_type == torch.autograd.DeviceType.CPU
            and event.name.startswith("aten::")
        ):
            per_kernel[event.name] += event.self_cpu_time_total / 1e3
    by_cat = defaultdict(float)
    for name, ms in per_kernel.items():
        by_cat[category(name)] += ms
    per_step = {cat: round(ms / steps, 4) for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]
    busy = sum(per_kernel.values()) / steps
    return per_step, [(name[:90], round(ms / steps, 4)) for name, ms in top], busy


def measure(args, fused: bool, cuda_rope: bool = True) -> dict:
    """One engine, built with the fused kernels on or off and the CUDA decode kernel's RoPE + store on or off
    (both read at capture: set before the engine)."""
    from tidal.rollout.models import layers

    if args.device.startswith("cuda"):
        from tidal.rollout.kernels import triton_attention

        triton_attention.FP8_CUDA_ROPE = cuda_rope

    layers.FUSED_KERNELS = fused
    with tempfile.TemporaryDirectory() as tmp:
        engine, vocab = build_engine(args, tmp)
        start_batch(engine, args, vocab)
        for _ in range(4):  # warm-up: graph capture, first-call allocations
            engine.step()
        phases = host_phases(engine, args)
        kernels, top, busy = kernel_profile(engine, args)
        engine_async = engine.async_scheduling
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the next engine sizes its KV cache from the free memory
    result = {
        "bench": "profile_decode",
        "model": args.config or "tiny-qwen2",
        "layers": args.layers or None,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "temperature": args.temperature,
        "enforce_eager": args.enforce_eager,
        "tp_size": args.tp_size,
        "final_only": args.final_only,
        "fused_kernels": fused,
        "cuda_rope": cuda_rope,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "async_scheduling": engine_async,
        "host_ms": phases,
        "kernel_ms": kernels,
        "gpu_busy_ms": round(busy, 4),
        "gpu_idle_ms": round(phases["step_wall"] - busy, 4),
        "torch": torch.__version__,
    }
    return report(f"fused_kernels={fused} cuda_rope={cuda_rope}", top, result)


def report(label: str, top: list, result: dict) -> dict:
    """The top kernels on stderr under ``label``, the result as one JSON line on stdout; the result."""
    print(f"{label}:", file=sys.stderr)
    for name, ms in top:
        print(f"{ms:9.4f} ms/step  {name}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> dict | list[dict]:
    args = parse_args(argv)
    results = [
        measure(args, fused, cuda_rope)
        for fused in SETTINGS[args.fused_kernels]
        for cuda_rope in SETTINGS[args.cuda_rope]
    ]
    return results[0] if len(results) == 1 else results


if __name__ == "__main__":
    main()
