"""Fixtures for 1-vs-N-process tests: launch ``dist_runner.py`` under torchrun (CPU, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as torch_dist

from tidal.testing.tolerance import assert_same_steps, tiny_parameter_count

RUNNER = Path(__file__).with_name("dist_runner.py")
# Forks the ranks from one process that imported torch/transformers/the trainers once (see its docstring).
FORK_LAUNCHER = Path(__file__).parents[1] / "trainers" / "conftest.py"


def torchrun(specs: list[dict], folder: Path, nproc: int = 2, timeout: int = 300, fork: bool = False) -> None:
    """Run ``specs`` (see dist_runner.py) in one ``torchrun --standalone`` launch, or with ``fork`` in one
    launch of ``FORK_LAUNCHER`` (the same rank variables, ~9 s less CPU per launch); fail with its stderr."""
    runs = folder / "runs.json"
    runs.write_text(json.dumps(specs))
    launcher = [str(FORK_LAUNCHER), str(nproc)] if fork else ["-m", "torch.distributed.run", "--standalone",
                                                              "--nproc_per_node", str(nproc)]  # fmt: skip
    cmd = [sys.executable, *launcher, str(RUNNER), str(runs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, failure_report(proc.stderr)


def failure_report(stderr: str, size: int = 3000) -> str:
    """A failed launch's stderr for the assertion: the first traceback (the rank that failed first prints
    it; the other's error usually follows from it) and the end (the fork launcher's line of how each rank
    ended)."""
    first = stderr.find("Traceback (most recent call last)")
    if first < 0 or first >= len(stderr) - size:
        return stderr[-2 * size :]
    return stderr[max(0, first - 200) : first + size] + "\n[...]\n" + stderr[-size:]


def result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def assert_steps_match(
    one: list[dict], two: list[dict], keys: tuple[str, ...], tol: float | None = None
) -> None:
    """Per-step metrics of a 1-process and an N-process run agree up to reordering their sums
    (``tidal.testing.tolerance``, for the tiny model's parameter count); ``tol``: a fixed tighter bound,
    for runs that must repeat the same order (a resume onto as many processes)."""
    if tol is None:
        assert_same_steps(one, two, keys, tiny_parameter_count("qwen2"))
        return
    assert len(one) == len(two) and one, (len(one), len(two))
    for a, b in zip(one, two, strict=True):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=tol, abs=tol), (key, a["step"], a[key], b[key])


@pytest.fixture(scope="session")
def dist():
    """The helpers above, for tests and module-scoped fixtures (test modules cannot import each other
    under importlib mode)."""
    return type("Dist", (), {"torchrun": staticmethod(torchrun), "result": staticmethod(result),
                             "assert_steps_match": staticmethod(assert_steps_match)})  # fmt: skip


@pytest.fixture
def own_process_group():
    """The one-process group FSDP2 on one device starts (offload, reduce dtype), torn down after the test."""
    assert not torch_dist.is_initialized()
    yield
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
