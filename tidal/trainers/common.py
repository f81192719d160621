"""Wiring shared by the trainers that run on ``SupervisedTrainer`` with a second, frozen model
(DPO, KTO, KD): the step count check and the run folder."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from tidal.config import CheckpointConfig, ConfigError, TrainConfig
from tidal.distributed import World


def training_steps(n_samples: int, train: TrainConfig, world: World, dataset: str) -> int:
    """Optimizer steps of the run; fails early on batch arithmetic or too little data."""
    train.micro_steps_per_step(world.world_size)  # validates the batch arithmetic early
    steps = (n_samples // train.train_batch_size) * train.max_epochs
    if steps == 0:
        raise ConfigError(
            f"--dataset {dataset}: {n_samples} usable samples is fewer than one --train_batch_size "
            f"({train.train_batch_size})"
        )
    return steps


def run_folder(run_dir: str | None, ckpt: CheckpointConfig) -> Path:
    """Where metrics and the run config go (``<save_path>/run`` unless the run names one)."""
    return Path(run_dir or Path(ckpt.save_path) / "run")


def flat_config(run) -> dict:
    """The run's configs as one plain dict, recorded with the metrics."""
    return dict(asdict(run))
