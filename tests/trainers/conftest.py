"""Fixtures shared by the trainer tests: a reference model that differs from the tiny policy, a crash after N
steps (``crash_after``, for the resume tests), and a launcher of N-process (gloo) runs.

The launcher is this file run as a script: ``python conftest.py NPROC SCRIPT ARGS...`` imports the heavy
modules every rank needs (torch, transformers, the trainers) once, then forks NPROC ranks that run SCRIPT
with the variables torchrun sets for them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; Ray mode launches its ranks with the same ones). Each rank is a process of its own with
its own gloo process group, as under torchrun, but the ~7 s CPU of imports is paid once, not per rank.
The parent is single-threaded when it forks (OMP_NUM_THREADS=1, nothing run yet), so forking is safe.
tests/distributed/conftest.py's ``torchrun(..., fork=True)`` launches ``dist_runner.py`` with it too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# What the ranks of the trainer tests import anyway; imported before forking so that they share it.
PRELOAD = ("torch", "transformers.optimization", "tidal.distributed.weight_sync", *(
    f"tidal.{package}{kind}" for kind in ("sft", "dpo", "kto", "rm", "kd", "ppo")
    for package in ("cli.train_", "trainers.")))  # fmt: skip


def launch(script: Path, *args: str, nproc: int = 2, timeout: int = 600) -> None:
    """Run ``script args`` as ``nproc`` ranks (see the module docstring); fail with their stderr."""
    cmd = [sys.executable, __file__, str(nproc), str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="session")
def ranks():
    """``ranks.launch(script, *args, nproc=2)``: the launcher above (test modules cannot import it)."""
    return type("Ranks", (), {"launch": staticmethod(launch)})


@pytest.fixture(scope="session")
def perturbed_llama(tiny_llama, tmp_path_factory):
    """``tiny_llama`` with 0.05 x N(0, 1) (seed 0) added to every weight: a DPO/KTO reference that differs
    from the policy, so the log-ratios (and KTO's KL reference point) are not all zero."""
    from tidal.testing import perturbed_copy

    return perturbed_copy(tiny_llama, tmp_path_factory.mktemp("perturbed_llama"), 0.05, seed=0)


@pytest.fixture
def crash_after(monkeypatch):
    """``crash_after(cls, "method", n)``: from its call n + 1 on, ``cls.method`` raises KeyboardInterrupt, as
    a crash right after n steps would. Returns a function that restores the method (for the resumed run)."""

    def arm(cls: type, name: str, n: int):
        original, calls = getattr(cls, name), {"n": 0}

        def crashing(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] > n:
                raise KeyboardInterrupt
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, crashing)
        return lambda: monkeypatch.setattr(cls, name, original)

    return arm


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> int:
    """Rank ``rank``'s run of ``script`` in this (forked) process: its exit status."""
    import runpy
    import traceback

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).parent)  # as ``python script``: its folder first on the path
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        print(f"[rank {rank}] failed:", file=sys.stderr)
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def fork_ranks(nproc: int, script: str, args: list[str]) -> int:
    """Fork the ranks; wait for all; on the first failure stop the others (a peer waiting in a collective
    would otherwise hang until its timeout). Non-zero when any rank failed."""
    import importlib
    import signal

    for name in PRELOAD:
        importlib.import_module(name)
    port, children = free_port(), {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os._exit(run_rank(rank, nproc, port, script, args))
        children[pid] = rank
    failed, ends = 0, []
    while children:
        pid, status = os.wait()
        rank, code = children.pop(pid), os.waitstatus_to_exitcode(status)
        ends.append(f"rank {rank} " + (f"killed by signal {-code}" if code < 0 else f"exit status {code}"))
        if code != 0 and not failed:
            failed = 1
            for other in children:
                os.kill(other, signal.SIGTERM)
    if failed:  # last on stderr, where a failed test's message shows it: which rank ended first, and how
        print("fork launcher: " + ", then ".join(ends), file=sys.stderr)
    return failed


if __name__ == "__main__":
    sys.exit(fork_ranks(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
