"""``--help`` stays fast by importing no heavy library: the command modules import torch, transformers
and datasets lazily (checked on ``sys.modules`` in a fresh interpreter, not timed)."""

from __future__ import annotations

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


# Commands whose parsers build from light config modules. The trainers' (sft, ppo...) still import
# torch: their run dataclasses live in the trainer modules.
LIGHT_COMMANDS = ("lora_combiner", "generate", "batch_inference", "chat", "interactive_chat", "serve_rm")


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in LIGHT_COMMANDS)])
def test_help_imports_no_heavy_library(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[-1] == ""


def test_building_the_cli_helpers_imports_no_heavy_library():
    """``tidal.cli.common`` resolves its error classes when a command runs, not at import."""
    modules = "import sys, tidal.cli.common, tidal.cli.openrlhf"
    code = f"{modules}; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
