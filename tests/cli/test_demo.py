"""``tidal demo`` runs every stage end to end and prints the README's table (learning itself is tested per trainer)."""

from __future__ import annotations

import json
from pathlib import Path

from tidal.cli.demo import main as demo_main
from tidal.cli.main import main as tidal_main


def readme_demo_table() -> list[str]:
    """The lines of the README's demo table (the code block after "make demo")."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    block = text[text.index("  stage      greedy") :]
    return block[: block.index("```")].rstrip("\n").splitlines()


def test_the_demo_prints_the_readme_table_and_writes_its_plot(tmp_path, capsys):
    """``make demo`` (the default flags) with the pinned versions of requirements.lock prints exactly the
    table the README shows: a refreshed lock that changes a figure fails here until the README is updated."""
    demo_main(["--output_dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["accuracy"]) == {"base", "sft", "sft+grpo", "sft+dpo"}
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    out = capsys.readouterr().out.splitlines()
    table = out[out.index("=== tidal demo: exact answers on addition test prompts ===") + 1 :][:6]
    assert table == readme_demo_table()


def test_tidal_lists_commands(capsys):
    tidal_main(["--help"])
    out = capsys.readouterr().out
    for command in ("sft", "rm", "dpo", "kto", "kd", "ppo", "demo", "lora_combiner", "serve_rm"):
        assert f"  {command} " in out
