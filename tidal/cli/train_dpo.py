"""``tidal dpo`` / ``python -m tidal.cli.train_dpo``: DPO, IPO (``--ipo``) and cDPO
(``--label_smoothing``) on preference pairs, with the seed's flags."""

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
from tidal.data.pairs import PairDataConfig
from tidal.logging import LoggingConfig
from tidal.trainers.dpo import DPOConfig
from tidal.trainers.reference import ReferenceConfig

# DPORun field → (config class, --help group title)
CONFIGS = {
    "model": (ModelConfig, "model (the policy)"),
    "ref": (ReferenceConfig, "reference model"),
    "dpo": (DPOConfig, "DPO loss"),
    "datasets": (DatasetConfig, "datasets"),
    "data": (PairDataConfig, "preference pairs"),
    "train": (TrainConfig, "training"),
    "optim": (OptimConfig, "optimizer"),
    "ckpt": (CheckpointConfig, "checkpoints"),
    "logging": (LoggingConfig, "logging"),
    "dist": (DistributedConfig, "distributed (FSDP2)"),
}


def build_parser(prog: str = "tidal dpo") -> argparse.ArgumentParser:
    return make_parser(prog, "Direct preference optimisation (DPO, IPO, cDPO).", list(CONFIGS.values()))


def run_from_namespace(ns: argparse.Namespace):
    """The ``DPORun`` described by parsed flags."""
    from tidal.trainers.dpo import DPORun

    return DPORun(**{name: config_from_args(cls, ns) for name, (cls, _) in CONFIGS.items()})


def parse_run(argv: list[str]):
    """Flags → ``DPORun`` without training (for scripts and tests)."""
    return run_from_namespace(build_parser().parse_args(argv))


def run_from_args(ns: argparse.Namespace):
    from tidal.trainers.dpo import run_dpo

    return run_dpo(run_from_namespace(ns))


def main(argv: list[str] | None = None, prog: str = "tidal dpo"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.train_dpo"))
