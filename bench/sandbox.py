"""Benchmark: the per-sample cost of the code sandbox (``tidal.rewards.sandbox``), bubblewrap vs none.

Times ``run_tests`` of a small correct solution (MBPP-style, 3 literal asserts) and of a stdin/stdout
program (3 cases), ``--reps`` times each, with ``isolation="bwrap"`` (the default: namespaces, seccomp,
the pids cgroup when root) and ``isolation="none"`` (the same harness in a plain child process),
interleaved in the same run so both see the same machine load. The overhead of the sandbox is the
difference of the medians (and of the minimums, which a loaded machine moves less). Also times ``run_many`` over ``--batch`` samples at ``--concurrency``.

Prints one JSON line: ``{"reps": .., "asserts": {"bwrap_ms": .., "none_ms": .., "overhead_ms": ..,
"bwrap_min_ms": .., "none_min_ms": .., "overhead_min_ms": ..},
"io": {...}, "batch": {"samples": .., "concurrency": .., "bwrap_ms_per_sample": ..,
"none_ms_per_sample": ..}, "seccomp": .., "bwrap": .., "python": .., "cpus": .., "load_average": ..}``.

    python bench/sandbox.py
    python bench/sandbox.py --reps 100 --batch 64 --concurrency 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tidal.rewards.sandbox import SandboxLimits, TestCase, run_many, run_tests  # noqa: E402
from tidal.rewards.sandbox.seccomp import filter_program  # noqa: E402

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(-1, 1) == 0"
SUM = "print(sum(map(int, input().split())))"
SUM_TESTS = [TestCase("1 2\n", "3\n"), TestCase("2 2\n", "4\n"), TestCase("-1 1\n", "0\n")]
ISOLATIONS = ("bwrap", "none")


def time_one(code: str, tests, limits: SandboxLimits) -> float:
    start = time.perf_counter()
    result = run_tests(code, tests, limits)
    elapsed = time.perf_counter() - start
    if result.score != 1.0:
        raise SystemExit(f"bench/sandbox.py: expected a score of 1.0 with {limits.isolation}, got {result}")
    return elapsed * 1e3


def time_kind(code: str, tests, reps: int) -> dict:
    times = {isolation: [] for isolation in ISOLATIONS}
    for _ in range(reps):  # interleaved: both see the same load
        for isolation in ISOLATIONS:
            times[isolation].append(time_one(code, tests, SandboxLimits(isolation=isolation)))
    out = {}
    for stat, reduce in (("", statistics.median), ("min_", min)):  # the minimum is the least load-bound
        for isolation, t in times.items():
            out[f"{isolation}_{stat}ms"] = round(reduce(t), 2)
        out[f"overhead_{stat}ms"] = round(out[f"bwrap_{stat}ms"] - out[f"none_{stat}ms"], 2)
    return out


def time_batch(samples: int, concurrency: int) -> dict:
    out = {"samples": samples, "concurrency": concurrency}
    for isolation in ISOLATIONS:
        start = time.perf_counter()
        results = run_many([(ADD, ADD_TESTS)] * samples, SandboxLimits(isolation=isolation), concurrency)
        assert all(r.score == 1.0 for r in results), results
        out[f"{isolation}_ms_per_sample"] = round((time.perf_counter() - start) * 1e3 / samples, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="run_tests calls per isolation and kind")
    parser.add_argument("--batch", type=int, default=32, help="samples of the run_many timing")
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if args.reps < 1 or args.batch < 1 or args.concurrency < 1:
        raise SystemExit("bench/sandbox.py: --reps, --batch and --concurrency must be positive")
    for isolation in ISOLATIONS:  # warm up: the bwrap check, the seccomp filter, the none warning
        time_one(ADD, ADD_TESTS, SandboxLimits(isolation=isolation))
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    record = {
        "reps": args.reps,
        "asserts": time_kind(ADD, ADD_TESTS, args.reps),
        "io": time_kind(SUM, SUM_TESTS, args.reps),
        "batch": time_batch(args.batch, args.concurrency),
        "seccomp": filter_program() is not None,
        "bwrap": bwrap,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
