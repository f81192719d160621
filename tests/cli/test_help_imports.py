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


@pytest.mark.parametrize("argv", [["--help"], ["lora_combiner", "--help"]])
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
