"""Benchmark: the longest SFT sequence that trains with ring attention over N devices vs one, and the
step rate at a fixed length (issue #16, item 3).

Workload: a random-init model of a Qwen2.5 shape (``bench/train_step.py``'s CONFIGS; ``tiny`` on the CPU),
tidal's SFT step (``SupervisedTrainer.train_step`` with ``SFTObjective(packing=True)``, the model sharded
by ``build_optimization`` as ``tidal sft`` does: FSDP2 over the processes, AdamW, bf16 autocast over
float32 master weights on CUDA, float32 on the CPU), gradient checkpointing on, and inside
``use_ring(ring_group(...))`` as ``tidal sft --ring_attn_size N`` runs it. Each rank holds one sample of L
random tokens per step (batch 1, one packed row); with ring size N the N ranks of the group take turns
(``tidal.trainers.loop``): a step trains N sequences of L tokens, each split along the sequence over the N
devices, so its peak memory is about that of one sequence. The CLI is not run because it reports neither
per-step time nor peak memory, and every attempt would load and export a model folder.

For each ring size r of ``--ring_sizes`` (r processes: one plain process for 1, ``torchrun`` for more;
gloo on the CPU, NCCL on CUDA):

- ``measure``: ``--warmup`` + ``--steps`` steps at ``--measure_len``: step time (median after the
  warm-up), tokens/s (r·L per step) and peak memory per rank (``torch.cuda.max_memory_allocated``).
- ``search``: the longest L for which one optimizer step succeeds, by doubling from ``--start_len`` and
  then bisecting down to ``--resolution``, capped at ``--max_len``. Every attempt is a fresh process (an
  out-of-memory error poisons the CUDA allocator); an attempt that runs out of memory (``OutOfMemoryError``
  / "out of memory" in its stderr) does not fit; any other failure ends that ring size's part of the
  benchmark (its entry's ``error`` holds the child's last stderr lines) and the other ring sizes go on.

``--budget_s`` bounds the whole run: each ring size in turn gets an equal share of what is left for its
measurement and search; an attempt whose predicted time (its FLOPs scaled from the longest step that fitted,
plus the start-up seen so far) does not fit in the share ends the search (``stopped: "budget: ..."``), and
an attempt still running at the end of the share is killed (the measurement then reports ``stopped``).
  From the attempts' peaks the search also fits peak(L) = a + b·L, and a + b·L + c·L² from three lengths
  on, and reports where each crosses the device's memory (``extrapolated_max_len``): estimates, not runs
  (memory is about linear in L with flash attention; quadratic on the ring's plain path, float32 or CPU,
whose blocks build [chunk, chunk] masks).

Prints progress to stderr and one JSON line to stdout (``search.<r>.longest_len`` and
``longest_len_ratio_vs_ring1``, ``measure.<r>``: tokens/s and peak GB per rank at ``--measure_len``,
versions).

    python bench/ring_sft.py                                     # tiny, 1 and 2 CPU processes, < 2 min
    python bench/ring_sft.py --device cuda --config qwen2.5-1.5b # 2 GPUs, <= --budget_s 480

On CUDA the lengths default to --start_len 8192 (short attempts are cheap and give the memory fits more
points), --measure_len 32768, --resolution 4096, --max_len 1048576. Qwen2.5-1.5B's steps grow with L²
(attention; the ring's blocks run on flash kernels, ``tidal/models/ring_flash.py``), so the two searches
rarely both finish in one 10-minute call: the report says which stopped on the budget, and where the
memory fits cross the device's capacity. With two calls give each ring size its own:

    python bench/ring_sft.py --device cuda --config qwen2.5-1.5b --ring_sizes 1 --budget_s 480
    python bench/ring_sft.py --device cuda --config qwen2.5-1.5b --ring_sizes 2 --budget_s 480
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import (  # noqa: E402
    CONFIGS,
    make_model,
    make_samples,
    stub_missing_datasets,
    sync,
    train_flops,
    versions,
)

# (start_len, max_len, resolution, measure_len) when not given
DEFAULT_LENGTHS = {"cuda": (8192, 1 << 20, 4096, 32768), "cpu": (256, 512, 256, 256)}
STEP_LINE = re.compile(r"#   r=\d+ L=\d+ step \d+: ([0-9.]+) s$")  # a worker's progress line (``step_line``)
OOM_EXIT = 3  # a worker that ran out of memory exits with this code after saying so on stderr
OOM_MARKERS = ("outofmemoryerror", "out of memory", "cublas_status_alloc_failed")


class BenchError(RuntimeError):
    """An attempt failed for a reason other than memory: its ring size's part of the benchmark stops."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", default=None, choices=sorted(CONFIGS), help="tiny on the CPU, else qwen2.5-1.5b"
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--ring_sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--ring_head_stride", type=int, default=1)
    p.add_argument("--start_len", type=int, default=None)
    p.add_argument("--max_len", type=int, default=None)
    p.add_argument(
        "--resolution", type=int, default=None, help="the search stops when its bounds are this close"
    )
    p.add_argument("--measure_len", type=int, default=None, help="0: no measurement")
    p.add_argument("--steps", type=int, default=2, help="timed steps at --measure_len")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget_s", type=float, default=480.0)
    p.add_argument("--folder", default="/tmp/tidal_ring_sft")
    # one attempt (the script runs itself with these)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.config = args.config or ("qwen2.5-1.5b" if args.device == "cuda" else "tiny")
    defaults = DEFAULT_LENGTHS[args.device]
    for i, name in enumerate(("start_len", "max_len", "resolution", "measure_len")):
        if getattr(args, name) is None:
            setattr(args, name, defaults[i])
    if min(args.ring_sizes) < 1 or min(args.start_len, args.max_len, args.resolution) < 1:
        p.error("--ring_sizes, --start_len, --max_len and --resolution must be positive")
    return args


# ---- the search (pure) ----------------------------------------------------------------------------
def next_length(known: dict[int, bool], start: int, resolution: int, max_len: int) -> int | None:
    """The next length to try given ``known`` (length → fitted), or None when the search is done: the
    first untried length of ``start``·2^k (the last capped at ``max_len``) while every length tried above
    the longest fit fitted, then bisection between the longest fit and the shortest failure above it until
    they are within ``resolution`` (a multiple of it when rounding allows)."""
    lo = max((n for n, ok in known.items() if ok), default=0)
    hi = min((n for n, ok in known.items() if not ok and n > lo), default=None)
    if hi is None:
        n = start
        while n in known and n < max_len:
            n *= 2
        n = min(n, max_len)
        return None if n in known else n
    if hi - lo <= resolution:
        return None
    mid = (lo + hi) // 2 // resolution * resolution
    if mid <= lo:
        mid = lo + resolution
    return mid if mid < hi else None


def longest(known: dict[int, bool]) -> int:
    return max((n for n, ok in known.items() if ok), default=0)


def fit_capacity(points: list[tuple[int, float]], capacity_gb: float, degree: int) -> int | None:
    """Where the least-squares polynomial of ``degree`` through ``points`` (length, peak GB) reaches
    ``capacity_gb``, or None (fewer distinct lengths than the fit needs, or a fit that never gets there)."""
    import numpy as np

    if len({n for n, _ in points}) <= degree:
        return None
    x = np.array([n for n, _ in points], dtype=np.float64)
    y = np.array([gb for _, gb in points], dtype=np.float64)
    coeffs = np.polyfit(x / x.max(), y, degree)  # scaled: a well-conditioned fit
    coeffs[-1] -= capacity_gb
    roots = [r.real * x.max() for r in np.roots(coeffs) if abs(r.imag) < 1e-9 and r.real > 0]
    return int(min(roots)) if roots else None


def predicted_seconds(length: int, known_steps: dict[int, float], flops) -> float | None:
    """One step at ``length``, scaled by ``flops`` from the longest step timed so far."""
    if not known_steps:
        return None
    ref = max(known_steps)
    return known_steps[ref] * flops(length) / flops(ref)


def step_flops(name: str):
    """``L → FLOPs`` of one sequence's training step (``train_step.train_flops``, on a meta-device model)."""
    import torch

    model = make_model(name, torch.device("meta"))
    return lambda length: train_flops(model, [length])[0]


# ---- one attempt (a fresh process, or r of them under torchrun) -----------------------------------
def worker(args) -> None:
    """Train ``--warmup`` + ``--steps`` steps at ``--length`` on this rank; rank 0 writes the JSON result.
    Out of memory: say so on stderr and exit at once with ``OOM_EXIT`` (torchrun then stops the other
    ranks, which may be waiting in a collective)."""
    import torch

    try:
        result = run_steps(args)
    except torch.OutOfMemoryError as err:
        print(f"out of memory at length {args.length}: {str(err)[:300]}", file=sys.stderr, flush=True)
        os._exit(OOM_EXIT)
    if result is not None:
        Path(args.worker_out).write_text(json.dumps(result))


def run_steps(args) -> dict | None:
    import torch

    from tidal.config import CheckpointConfig, DistributedConfig, ModelConfig, OptimConfig, TrainConfig
    from tidal.distributed import init_world, shutdown
    from tidal.distributed.collectives import all_gather_objects
    from tidal.distributed.mesh import ring_group
    from tidal.logging import LoggingConfig
    from tidal.models.ring_attention import use_ring
    from tidal.trainers.loop import SupervisedTrainer
    from tidal.trainers.optimization import build_optimization
    from tidal.trainers.sft import SFTObjective

    stub_missing_datasets()
    if args.device == "cpu":
        torch.set_num_threads(1)  # the ranks share the host's cores
    world = init_world("cpu" if args.device == "cpu" else None)
    ring_size = world.world_size  # one ring group over every process
    ring = ring_group(world, ring_size, args.ring_head_stride)
    length, steps = args.length, args.warmup + args.steps
    model = make_model(args.config, world.device, gradient_checkpointing=True, seed=0,
                       max_position_embeddings=max(length, 32768))  # fmt: skip
    dist_cfg = DistributedConfig(ring_attn_size=ring_size, ring_head_stride=args.ring_head_stride)
    model_cfg = ModelConfig(pretrain=args.config, param_dtype="bf16" if args.device == "cuda" else "fp32")
    opt = build_optimization(model, model_cfg, OptimConfig(learning_rate=1e-6), dist_cfg, world, steps)
    train_cfg = TrainConfig(train_batch_size=world.world_size, micro_train_batch_size=1, packing_samples=True)
    run_dir = Path(args.worker_out).with_suffix(".run")
    trainer = SupervisedTrainer(
        SFTObjective(pad_id=0, packing=True), opt, None, world, train_cfg, CheckpointConfig(), LoggingConfig(),
        run_dir,
    )  # fmt: skip
    vocab = CONFIGS[args.config]["vocab_size"]
    times, losses = [], []
    with use_ring(ring):
        for step in range(steps):
            samples = make_samples(1, vocab, length, length, seed=1000 * step + world.rank)
            sync(world.device)
            start = time.perf_counter()
            stats = trainer.train_step(samples)
            sync(world.device)
            times.append(time.perf_counter() - start)
            losses.append(stats["loss"])
            if world.is_main:
                print(step_line(ring_size, length, step, times[-1]), file=sys.stderr, flush=True)
    cuda = world.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(world.device) / 2**30 if cuda else None
    peaks = all_gather_objects(peak, world)
    total = torch.cuda.get_device_properties(world.device).total_memory / 2**30 if cuda else None
    result = {"length": length, "ring": ring_size, "step_s": times, "losses": losses, "peak_gb": peaks,
              "device_gb": total, "tokens_per_step": ring_size * length}  # fmt: skip
    shutdown(world)
    return result if world.is_main else None


def step_line(ring: int, length: int, step: int, seconds: float) -> str:
    """A worker's progress line; the parent also reads step times from it (``STEP_LINE``)."""
    return f"#   r={ring} L={length} step {step}: {seconds:.3f} s"


@dataclass
class Attempt:
    """What one fresh-process attempt found: ``fits`` True/False, or None when it was cut off (budget)."""

    length: int
    fits: bool | None
    wall_s: float
    result: dict = field(default_factory=dict)
    steps_seen: list[float] = field(default_factory=list)  # step times a cut-off attempt had reported


def launch(args, ring: int, length: int, warmup: int, steps: int, timeout: float) -> Attempt:
    """Run one attempt in fresh processes; out of memory → ``fits=False``, past ``timeout`` → None."""
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"r{ring}_L{length}_{time.monotonic_ns()}.json"
    launcher = [sys.executable]
    if ring > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ring)]
    cmd = launcher + [
        str(Path(__file__).resolve()), "--config", args.config, "--device", args.device,
        "--ring_head_stride", str(args.ring_head_stride), "--length", str(length), "--warmup", str(warmup),
        "--steps", str(steps), "--worker_out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1") if args.device == "cpu" else dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = env.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        return run_attempt(cmd, length, out, timeout, env)
    except BenchError as err:
        raise BenchError(f"ring {ring}, length {length}: {err}") from None


def run_attempt(cmd: list[str], length: int, out: Path, timeout: float, env: dict | None = None) -> Attempt:
    """Run ``cmd`` (which writes its JSON result to ``out``) in a process group of its own: the result, an
    out-of-memory failure (``fits=False``), or None past ``timeout`` (the group is killed); any other
    failure raises ``BenchError`` with its last stderr lines."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    stderr = StderrTail(proc.stderr)
    try:
        proc.wait(timeout=max(timeout, 1.0))
        cut_off = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: our own process group
        proc.wait()
        cut_off = True
    stderr.close()
    wall = time.monotonic() - start
    if cut_off:
        return Attempt(length, None, wall, steps_seen=stderr.step_times)
    if proc.returncode == 0 and out.exists():
        return Attempt(length, True, wall, json.loads(out.read_text()))
    if stderr.oom:
        return Attempt(length, False, wall)
    raise BenchError(f"exit {proc.returncode}\n{stderr.tail()}")


def is_oom(line: str) -> bool:
    """Whether a line of a failed attempt's stderr says it ran out of device memory."""
    text = line.lower()
    return any(marker in text for marker in OOM_MARKERS)


class StderrTail:
    """Reads a child's stderr on a thread: passes its progress lines ("#") on, keeps the last lines and
    notes whether any line reported running out of memory."""

    def __init__(self, stream, keep: int = 25):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.oom = False
        self.step_times: list[float] = []  # from the worker's progress lines (``step_line``)
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
            self.oom = self.oom or is_oom(line)
            if line.startswith("#"):
                if match := STEP_LINE.match(line):
                    self.step_times.append(float(match[1]))
                sys.stderr.write(line)
                sys.stderr.flush()

    def close(self) -> None:
        self.thread.join(timeout=30)

    def tail(self) -> str:
        return "\n".join(self.lines)


# ---- the benchmark ---------------------------------------------------------------------------------
def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def measure(args, ring: int, deadline: float) -> tuple[dict, Attempt | None]:
    """The ``--measure_len`` run of ``ring``: its report entry and the attempt (None when skipped)."""
    length = args.measure_len
    if length <= 0 or length > args.max_len:
        return {"skipped": f"--measure_len {length}"}, None
    try:
        attempt = launch(args, ring, length, args.warmup, args.steps, deadline - time.monotonic())
    except BenchError as err:
        return {"length": length, "error": str(err)}, None
    if attempt.fits is None:  # cut off: the steps it reported still give a rate
        entry = {"length": length, "stopped": "budget", "wall_s": round(attempt.wall_s, 1)}
        seen = attempt.steps_seen
        if seen:
            timed = seen[args.warmup :] or seen
            step_s = statistics.median(timed)
            entry.update(step_s=round(step_s, 3), tokens_per_s=round(ring * length / step_s),
                         tokens_per_s_per_device=round(length / step_s), steps_timed=len(timed),
                         warmup_included=not seen[args.warmup :])  # fmt: skip
        return entry, attempt
    if not attempt.fits:
        return {"length": length, "out_of_memory": True}, attempt
    r = attempt.result
    step_s = statistics.median(r["step_s"][args.warmup :] or r["step_s"])
    entry = {"length": length, "step_s": round(step_s, 3), "tokens_per_s": round(r["tokens_per_step"] / step_s),
             "tokens_per_s_per_device": round(r["tokens_per_step"] / step_s / ring), "peak_gb": rounded(r["peak_gb"]),
             "first_loss": round(r["losses"][0], 4), "wall_s": round(attempt.wall_s, 1)}  # fmt: skip
    return entry, attempt


def rounded(values: list) -> list:
    return [None if v is None else round(v, 2) for v in values]


def search(args, ring: int, deadline: float, seeded: list[Attempt], flops) -> dict:
    """The longest fitting length for ``ring`` by ``next_length``, attempts in fresh processes, stopping
    before an attempt that is predicted to end after ``deadline``."""
    known = {a.length: a.fits for a in seeded if a.fits is not None}
    steps = {a.length: min(a.result["step_s"]) for a in seeded if a.fits}
    overheads = [a.wall_s - sum(a.result["step_s"]) for a in seeded if a.fits]
    attempts, stopped, error = [], None, None
    while (length := next_length(known, args.start_len, args.resolution, args.max_len)) is not None:
        left = deadline - time.monotonic()
        step = predicted_seconds(length, steps, flops)
        guess = None if step is None else step + (max(overheads) if overheads else 0.0)
        if left <= 0 or (guess is not None and guess > left):
            stopped = f"budget: L={length} predicted {guess and round(guess)} s, {left:.0f} s left"
            break
        log(f"ring {ring}: trying L={length} (predicted {guess and round(guess)} s, {left:.0f} s left)")
        try:
            attempt = launch(args, ring, length, 0, 1, left)
        except BenchError as err:
            stopped, error = "error", str(err)
            break
        attempts.append(attempt)
        if attempt.fits is None:
            stopped = f"budget: L={length} cut off after {attempt.wall_s:.0f} s"
            break
        known[length] = attempt.fits
        if attempt.fits:
            steps[length] = attempt.result["step_s"][0]
            overheads.append(attempt.wall_s - steps[length])
        log(f"ring {ring}: L={length} {'fits' if attempt.fits else 'out of memory'} ({attempt.wall_s:.0f} s)")
    tried = [a for a in seeded + attempts if a.fits is not None]
    points = [
        (a.length, max(a.result["peak_gb"])) for a in tried if a.fits and a.result["peak_gb"][0] is not None
    ]
    capacity = next((a.result["device_gb"] for a in tried if a.fits and a.result["device_gb"]), None)
    entry = {
        "longest_len": longest(known),
        "shortest_oom_len": min(
            (n for n, ok in known.items() if not ok and n > longest(known)), default=None
        ),
        "attempts": {str(a.length): a.fits for a in tried},
        "peak_gb_by_len": {str(n): round(gb, 2) for n, gb in sorted(points)},
        "stopped": stopped or ("max_len" if longest(known) >= args.max_len else "resolution"),
    }
    if error:
        entry["error"] = error
    if capacity:  # peak memory linear in L (flash attention) or quadratic (the ring's [chunk, chunk] masks)
        entry["device_gb"] = round(capacity, 1)
        entry["extrapolated_max_len"] = {
            "linear": fit_capacity(points, capacity, 1),
            "quadratic": fit_capacity(points, capacity, 2),
        }
    return entry


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return {}
    start = time.monotonic()
    deadline = start + args.budget_s
    flops = step_flops(args.config)
    report = {"bench": "ring_sft", **versions(), "device": args.device, "config": args.config,
              "ring_sizes": args.ring_sizes, "ring_head_stride": args.ring_head_stride, "budget_s": args.budget_s,
              "lengths": {"start": args.start_len, "max": args.max_len, "resolution": args.resolution,
                          "measure": args.measure_len}, "measure": {}, "search": {}}  # fmt: skip
    for i, ring in enumerate(args.ring_sizes):  # each ring size: an equal share of what is left
        share_end = time.monotonic() + (deadline - time.monotonic()) / (len(args.ring_sizes) - i)
        report["measure"][str(ring)], attempt = measure(args, ring, share_end)
        log(f"ring {ring} at {args.measure_len}: {report['measure'][str(ring)]}")
        if "error" in report["measure"][str(ring)]:  # a ring size failing other than by memory: done
            continue
        report["search"][str(ring)] = search(args, ring, share_end, [attempt] if attempt else [], flops)
        log(f"ring {ring} search: {report['search'][str(ring)]}")
    base = report["search"].get("1", {}).get("longest_len")  # vs one device, when it was searched
    report["longest_len_ratio_vs_ring1"] = {
        ring: round(entry["longest_len"] / base, 3) for ring, entry in report["search"].items() if base
    }
    report["wall_s"] = round(time.monotonic() - start, 1)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
