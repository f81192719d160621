"""``tidal kd`` / ``python -m tidal.cli.train_kd``: knowledge distillation from ``--teacher_model``
on SFT data, with the seed's flags."""

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
from tidal.data import SFTDataConfig
from tidal.logging import LoggingConfig
from tidal.trainers.kd import KDConfig

GROUPS = [
    (ModelConfig, "model (the student)"),
    (KDConfig, "distillation"),
    (DatasetConfig, "datasets"),
    (SFTDataConfig, "SFT data"),
    (TrainConfig, "training"),
    (OptimConfig, "optimizer"),
    (CheckpointConfig, "checkpoints"),
    (LoggingConfig, "logging"),
    (DistributedConfig, "distributed (FSDP2)"),
]


def build_parser(prog: str = "tidal kd") -> argparse.ArgumentParser:
    return make_parser(prog, "Knowledge distillation from a frozen teacher on SFT data.", GROUPS)


def run_from_namespace(ns: argparse.Namespace):
    """The ``KDRun`` described by parsed flags."""
    from tidal.trainers.kd import KDRun

    return KDRun(
        model=config_from_args(ModelConfig, ns),
        data=config_from_args(SFTDataConfig, ns),
        kd=config_from_args(KDConfig, ns),
        train=config_from_args(TrainConfig, ns),
        optim=config_from_args(OptimConfig, ns),
        ckpt=config_from_args(CheckpointConfig, ns),
        logging=config_from_args(LoggingConfig, ns),
        dist=config_from_args(DistributedConfig, ns),
        datasets=config_from_args(DatasetConfig, ns),
    )


def parse_run(argv: list[str]):
    """Flags → ``KDRun`` without training (for scripts and tests)."""
    return run_from_namespace(build_parser().parse_args(argv))


def run_from_args(ns: argparse.Namespace):
    from tidal.trainers.kd import run_kd

    return run_kd(run_from_namespace(ns))


def main(argv: list[str] | None = None, prog: str = "tidal kd"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.train_kd"))
