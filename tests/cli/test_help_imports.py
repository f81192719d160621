"""``--help`` stays fast by importing no heavy library: the command modules import torch, transformers
and datasets lazily (checked on ``sys.modules`` in a fresh interpreter, not timed). A ``--help`` that
exits before printing would pass vacuously, so the probe also checks that the usage was printed."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "datasets")

PROBE = """
import sys
from tidal.cli import main
try:
    main.main(sys.argv[1:])
except SystemExit:
    pass
print(",".join(m for m in {heavy!r} if m in sys.modules))
"""


# Every command whose parser builds from light config modules: the inference commands, and the trainers
# (their runs live in tidal.config.supervised and tidal.config.ppo; the trainer is imported
# when the command runs), under tidal's names and OpenRLHF's module names.
LIGHT_COMMANDS = (
    *(
        "lora_combiner",
        "generate",
        "batch_inference",
        "chat",
        "interactive_chat",
        "serve_rm",
        "serve",
        "demo",
    ),
    *("sft", "rm", "prm", "dpo", "kto", "kd", "ppo"),
    *("train_sft", "train_rm", "train_prm", "train_dpo", "train_kto", "train_kd", "train_ppo_ray"),
)


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in LIGHT_COMMANDS)])
def test_help_imports_no_heavy_library(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True, check=True
    ).stdout
    assert "usage:" in out
    assert out.splitlines()[-1] == ""


@pytest.mark.parametrize("name", ["sft", "rm", "prm", "dpo", "kto", "kd", "ppo"])
def test_trainer_runner_names_its_training_function(name):
    """Each trainer command names its runner as ``module:function`` (imported when it runs): the name
    resolves to that trainer's ``run_<kind>``, so a typo fails here, not after a user's flags parse."""
    command = importlib.import_module(f"tidal.cli.train_{name}").COMMAND
    module, _, function = command.runner.partition(":")
    assert function == f"run_{name}"
    assert callable(getattr(importlib.import_module(module), function))


def test_building_the_cli_helpers_imports_no_heavy_library():
    """``tidal.cli.common`` resolves its error classes when a command runs, not at import."""
    modules = "import sys, tidal.cli.common, tidal.cli.openrlhf"
    code = f"{modules}; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
