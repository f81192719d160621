"""Logging: metric sinks (JSONL, TensorBoard, W&B), console progress, plots and human messages.

Inside this package ``import logging`` is the standard library (absolute imports), not this package.
"""

from tidal.config.logging import LoggingConfig
from tidal.logging.console import get_logger
from tidal.logging.metrics import MetricsLogger
from tidal.logging.plots import plot_metrics, read_metrics
from tidal.logging.progress import ProgressBar, Throughput

__all__ = [
    "LoggingConfig",
    "MetricsLogger",
    "ProgressBar",
    "Throughput",
    "get_logger",
    "plot_metrics",
    "read_metrics",
]
