"""``tidal demo``'s ``curves.png``: one titled panel per stage (SFT, RM, GRPO, DPO), each its training
curve with the held-out results measured after it marked (``tidal.cli.demo.demo_panels``,
``tidal.logging.plots``); built here from small metrics files, not a demo run."""

from __future__ import annotations

import json

from tidal.cli.demo import demo_panels, plot_curves
from tidal.logging.plots import panels_figure

SUMMARY = {
    "accuracy": {
        "base": {"greedy": 0.0, "sampled": 0.0025},
        "sft": {"greedy": 0.81, "sampled": 0.22375},
        "sft+grpo": {"greedy": 0.91, "sampled": 0.675},
        "sft+dpo": {"greedy": 0.835, "sampled": 0.24625},
    },
    "reward_model_pair_accuracy": 0.9223,
}
CURVES = {"sft": "train/loss", "reward": "train/loss", "rl": "train/reward", "dpo": "train/loss"}


def _write_runs(root, stages=CURVES):
    for stage, key in stages.items():
        run = root / f"{stage}_model" / "run"
        run.mkdir(parents=True)
        lines = [json.dumps({"step": s, key: 1.0 / s, "train/score": 0.5}) for s in range(1, 6)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _legend(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_one_titled_panel_per_stage_with_its_results_marked(tmp_path):
    _write_runs(tmp_path)
    fig = panels_figure(demo_panels(tmp_path, SUMMARY))
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title().split(":")[0] for ax in panels] == ["SFT", "RM", "GRPO", "DPO"]
    sft, rm, grpo, dpo = (_legend(ax) for ax in panels)
    assert sft == ["train/loss", "greedy (base 0.0%): 81.0%", "sampled: 22.4%"]
    assert rm == ["train/loss", "held-out pair accuracy: 92.2%"]
    assert grpo == ["train/reward", "greedy (SFT 81.0%): 91.0%", "sampled (SFT 22.4%): 67.5%"]  # no score
    assert dpo == ["train/loss", "greedy (SFT 81.0%): 83.5%", "sampled (SFT 22.4%): 24.6%"]
    twin = [
        ax for ax in fig.axes if not ax.get_title()
    ]  # the held-out axes: 0-100%, dashed lines at the values
    assert [line.get_ydata()[0] for line in twin[2].get_lines()] == [91.0, 67.5]
    assert all(ax.get_ylim() == (0, 100) for ax in twin)


def test_a_stage_that_did_not_run_is_left_out(tmp_path):
    _write_runs(tmp_path, {"sft": "train/loss", "rl": "train/reward"})  # --skip_preference
    summary = {"accuracy": {k: SUMMARY["accuracy"][k] for k in ("base", "sft", "sft+grpo")}}
    png = plot_curves(tmp_path, summary)
    assert png == tmp_path / "curves.png" and png.read_bytes().startswith(b"\x89PNG")
