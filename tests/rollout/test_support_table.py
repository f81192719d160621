"""README's family table is the registry's (``tidal.rollout.models.support_table``)."""

from __future__ import annotations

from pathlib import Path

from tidal.rollout.batch_invariant.support import EXACT_MODEL_TYPES
from tidal.rollout.models import registry
from tidal.rollout.models.support_table import BEGIN, END, support_table


def test_readme_holds_the_registrys_table():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme[readme.index(BEGIN) : readme.index(END) + len(END)]
    assert block == support_table(), "paste `python -m tidal.rollout.models.support_table` into README.md"


def test_each_cell_follows_the_record():
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in support_table().splitlines()
        if line.startswith("| `")
    }
    assert set(rows) == set(registry.FAMILIES) | set(registry.VISION_FAMILIES)
    cells = [c.strip() for c in rows["qwen3_5_text"].split("|")[3:-1]]
    assert cells == [
        "yes",
        "yes",
        "yes",
        "yes",
        "yes",
        "no",
        "no",
    ]  # TP, prefix, chunked, graphs, async, packing, exact
    assert rows["llama"].rstrip(" |").endswith("CPU + CUDA") and "llama" in EXACT_MODEL_TYPES
