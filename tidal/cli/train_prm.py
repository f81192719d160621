"""``tidal prm`` / ``python -m tidal.cli.train_prm``: process-reward-model training (step labels)."""

from __future__ import annotations

import argparse

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import (
    CheckpointConfig,
    DatasetConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    config_from_args,
)
from tidal.data.prm import PRMDataConfig
from tidal.logging import LoggingConfig

GROUPS = [
    (ModelConfig, "model"),
    (DatasetConfig, "datasets"),
    (PRMDataConfig, "PRM data"),
    (TrainConfig, "training"),
    (OptimConfig, "optimizer"),
    (CheckpointConfig, "checkpoints"),
    (LoggingConfig, "logging"),
    (DistributedConfig, "distributed (FSDP2)"),
]


def build_parser(prog: str = "tidal prm") -> argparse.ArgumentParser:
    return make_parser(prog, "Train a process reward model on per-step labels.", GROUPS)


def run_from_namespace(ns: argparse.Namespace):
    """The ``PRMRun`` described by parsed flags (config errors raise ``ConfigError``/``DataError``)."""
    from tidal.trainers.prm import PRMRun

    return PRMRun(
        model=config_from_args(ModelConfig, ns),
        data=config_from_args(PRMDataConfig, ns),
        train=config_from_args(TrainConfig, ns),
        optim=config_from_args(OptimConfig, ns),
        ckpt=config_from_args(CheckpointConfig, ns),
        logging=config_from_args(LoggingConfig, ns),
        dist=config_from_args(DistributedConfig, ns),
        datasets=config_from_args(DatasetConfig, ns),
    )


def parse_run(argv: list[str]):
    """Flags → ``PRMRun`` without training (for scripts and tests)."""
    return run_from_namespace(build_parser().parse_args(argv))


def run_from_args(ns: argparse.Namespace):
    from tidal.trainers.prm import run_prm

    return run_prm(run_from_namespace(ns))


def main(argv: list[str] | None = None, prog: str = "tidal prm"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.train_prm"))
