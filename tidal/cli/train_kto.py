"""``tidal kto`` / ``python -m tidal.cli.train_kto``: KTO on unpaired desirable/undesirable samples,
with the seed's flags."""

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
from tidal.data.unpaired import UnpairedDataConfig
from tidal.logging import LoggingConfig
from tidal.trainers.kto import KTOConfig
from tidal.trainers.reference import ReferenceConfig

# KTORun field → (config class, --help group title)
CONFIGS = {
    "model": (ModelConfig, "model (the policy)"),
    "ref": (ReferenceConfig, "reference model"),
    "kto": (KTOConfig, "KTO loss"),
    "datasets": (DatasetConfig, "datasets"),
    "data": (UnpairedDataConfig, "unpaired samples"),
    "train": (TrainConfig, "training"),
    "optim": (OptimConfig, "optimizer"),
    "ckpt": (CheckpointConfig, "checkpoints"),
    "logging": (LoggingConfig, "logging"),
    "dist": (DistributedConfig, "distributed (FSDP2)"),
}


def build_parser(prog: str = "tidal kto") -> argparse.ArgumentParser:
    return make_parser(
        prog,
        "Kahneman-Tversky optimisation on unpaired desirable/undesirable samples.",
        list(CONFIGS.values()),
    )


def run_from_namespace(ns: argparse.Namespace):
    """The ``KTORun`` described by parsed flags."""
    from tidal.trainers.kto import KTORun

    return KTORun(**{name: config_from_args(cls, ns) for name, (cls, _) in CONFIGS.items()})


def parse_run(argv: list[str]):
    """Flags → ``KTORun`` without training (for scripts and tests)."""
    return run_from_namespace(build_parser().parse_args(argv))


def run_from_args(ns: argparse.Namespace):
    from tidal.trainers.kto import run_kto

    return run_kto(run_from_namespace(ns))


def main(argv: list[str] | None = None, prog: str = "tidal kto"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.train_kto"))
