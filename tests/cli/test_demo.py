"""``tidal demo`` runs every stage end to end (small budgets; learning itself is tested per trainer)."""

from __future__ import annotations

import json

from tidal.cli.demo import main as demo_main
from tidal.cli.main import main as tidal_main


def test_demo_runs_all_stages_and_writes_plot(tmp_path, capsys):
    demo_main([
        "--output_dir", str(tmp_path), "--train_samples", "256", "--sft_epochs", "1", "--eval_samples", "16",
        "--rl_rollouts", "2", "--preference_prompts", "64",
    ])  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["accuracy"]) == {"base", "sft", "sft+grpo", "sft+dpo"}
    assert all(0.0 <= v <= 1.0 for acc in summary["accuracy"].values() for v in acc.values())
    assert 0.0 <= summary["reward_model_pair_accuracy"] <= 1.0
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    out = capsys.readouterr().out
    assert "sft+grpo" in out and "reward model" in out


def test_tidal_lists_commands(capsys):
    tidal_main(["--help"])
    out = capsys.readouterr().out
    for command in ("sft", "rm", "dpo", "kto", "kd", "ppo", "demo", "lora_combiner", "serve_rm"):
        assert f"  {command} " in out
