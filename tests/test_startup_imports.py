"""Processes import what they use: a rollout engine process, a tensor-parallel worker and a command's
error handling start without ``datasets``, FSDP or torch.distributed.checkpoint (seconds of start-up
each, paid by every engine, worker and Ray actor), and the packages that import their names on first
use (``tidal.lazy``) still export every public name and submodule.

The probe runs in a fresh interpreter and checks ``sys.modules`` (nothing is timed)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

HEAVY = ("datasets", "torch.distributed.fsdp", "torch.distributed.checkpoint")

# An engine process (spawned child or Ray actor: ``_serve`` / ``WorkerActor`` building an
# ``EngineWorker``), a tensor-parallel worker (``python -m tidal.rollout.runner.tp_worker``), the weight-sync
# helpers torchrun's runner imports, ``tidal chat``'s modules, and the error classes every command
# resolves when it runs.
PROBE = f"""
import sys
import tidal.placement.workers, tidal.placement.engines
import tidal.rollout.runner.tp_worker, tidal.rollout.runner.model_runner, tidal.rollout.models.loader
import tidal.distributed.weight_sync
from tidal.distributed import barrier, init_world, shutdown
import tidal.agents, tidal.rewards
import tidal.inference.chat, tidal.inference.generate  # tidal chat
import tidal.cli.common
tidal.cli.common.error_kinds()
print([m for m in {HEAVY!r} if m in sys.modules])
"""

LAZY_PACKAGES = (
    "tidal.data",
    "tidal.distributed",
    "tidal.placement",
    "tidal.checkpoint",
    "tidal.trainers.ppo",
    "tidal.rollout",
)


def test_engine_worker_and_cli_processes_import_no_heavy_library():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_lazy_packages_export_every_public_name(name):
    package = importlib.import_module(name)
    assert set(package.__all__) <= set(package._EXPORTS)
    for attr, module in package._EXPORTS.items():
        assert getattr(package, attr) is getattr(importlib.import_module(module), attr)
        assert attr in dir(package)


def test_a_lazy_package_imports_its_submodules_by_name_and_refuses_unknown_names():
    import tidal.data
    from tidal.data import rows  # a submodule, as the eager __init__ made it an attribute

    assert rows is importlib.import_module("tidal.data.rows")
    assert tidal.data.loading is importlib.import_module("tidal.data.loading")
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tidal.data.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        from tidal.data import no_such_name  # noqa: F401


def test_the_family_registry_imports_no_torch():
    """``tidal demo --help`` reads its family choices from the registry: plain data, no engine, no torch."""
    probe = "import sys, tidal.rollout.models.registry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
