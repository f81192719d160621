"""Plots of ``metrics.jsonl``: one subplot per metric against step, saved as a PNG.

Uses matplotlib's Agg canvas directly (no pyplot), so it works headless and never changes the
process-wide backend.
"""

from __future__ import annotations

import json
import warnings
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
