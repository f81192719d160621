"""Plots of ``metrics.jsonl``: one subplot per metric against step (``plot_metrics``), or one titled
panel per training stage with its results marked (``plot_panels``: ``tidal demo``'s curves), saved as
a PNG.

Uses matplotlib's Agg canvas directly (no pyplot), so it works headless and never changes the
process-wide backend.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path


def read_metrics(jsonl_path: Path | str) -> list[dict]:
    """All records of a metrics JSONL file; a torn last line (crash mid-write) is skipped."""
    records = []
    for line in Path(jsonl_path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(
    jsonl_path: Path | str,
    out_png: Path | str,
    keys: list[str],
    title: str | None = None,
    smooth: int = 0,
) -> Path:
    """Plot ``keys`` (e.g. ``"train/loss"``) vs step into ``out_png``; ``smooth`` > 1 adds a moving mean."""
    # Imported here: matplotlib takes ~0.5 s to import and most runs never plot.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(jsonl_path)
    series = {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}
    missing = [k for k, points in series.items() if not points]
    if len(missing) == len(keys):
        raise ValueError(f"none of the keys {keys} are in {jsonl_path}")
    if missing:
        warnings.warn(f"metrics not found in {jsonl_path}, skipped: {missing}", stacklevel=2)
    series = {k: points for k, points in series.items() if points}
    fig = Figure(figsize=(6, 2.6 * len(series)), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (key, points) in zip(
        fig.subplots(len(series), 1, squeeze=False)[:, 0], series.items(), strict=True
    ):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, alpha=0.35 if smooth > 1 else 1.0, label=key)
        if smooth > 1:
            ax.plot(steps, moving_average(list(values), smooth), label=f"mean of {smooth}")
            ax.legend(fontsize="small")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


@dataclass
class Panel:
    """One stage's panel: ``keys`` of its ``metrics`` file against step (left axis), and ``marks``,
    results in [0, 1] measured after it (label → value), as labelled dashed lines on a 0-100% right axis."""

    title: str
    metrics: Path
    keys: list[str]
    marks: dict[str, float] = field(default_factory=dict)


def panels_figure(panels: list[Panel], title: str | None = None):
    """The matplotlib ``Figure`` of ``plot_panels`` (two columns, a panel per stage in order)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(2, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(6 * columns, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, panel in zip(axes, panels, strict=False):
        _draw_panel(ax, panel)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return fig


def _draw_panel(ax, panel: Panel) -> None:
    records = read_metrics(panel.metrics)
    for key in panel.keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), label=key)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if panel.marks:
        right = ax.twinx()
        right.set_ylim(0, 100)
        right.set_ylabel("held-out %")
        for (label, value), color in zip(
            panel.marks.items(), ("tab:green", "tab:red", "tab:purple"), strict=False
        ):
            right.axhline(100 * value, color=color, linestyle="--", label=f"{label}: {100 * value:.1f}%")
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize="small", loc="best")


def plot_panels(panels: list[Panel], out_png: Path | str, title: str | None = None) -> Path:
    """One titled panel per stage (``Panel``) into ``out_png``; a stage whose metrics file is missing
    (not run) is left out."""
    present = [p for p in panels if Path(p.metrics).exists()]
    if not present:
        raise ValueError(f"no metrics file of {[str(p.metrics) for p in panels]} exists")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    panels_figure(present, title).savefig(out_png, dpi=100)
    return out_png
