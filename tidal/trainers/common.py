"""Wiring shared by the trainers that run on ``SupervisedTrainer`` (SFT, RM, PRM, DPO, KTO, KD):
loading a dataset spec into samples, the step-count check, the optimizer stack and the run folder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from torch import nn

from tidal.config import (
    CheckpointConfig,
    ConfigError,
    DatasetConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from tidal.data import load_dataset_spec
from tidal.distributed import World, parallelize
from tidal.logging import get_logger
from tidal.models.precision import Precision
from tidal.trainers.loop import Optimization
from tidal.trainers.optim import NonFiniteGuard, build_optimizer, build_scheduler

log = get_logger(__name__)

# builder(dataset, tokenizer, cfg, source=...) -> (samples, SkipStats), e.g. build_sft_samples
SampleBuilder = Callable[..., tuple[list, object]]


def load_samples(
    builder: SampleBuilder, spec: str, probs, split: str, max_samples, tokenizer, cfg, seed: int
):
    """Load a ``--dataset``-style spec and build its samples; skipped rows are logged."""
    dataset = load_dataset_spec(spec, probs, split=split, max_samples=max_samples, seed=seed)
    samples, skipped = builder(dataset, tokenizer, cfg, source=spec)
    if skipped.count:
        log.warning("%s: %s", spec, skipped.summary())
    return samples


def train_and_eval_samples(load: Callable, ds: DatasetConfig, tokenizer, cfg, seed: int):
    """``(train, eval or None)`` samples with ``load(spec, probs, split, max_samples, tokenizer, cfg, seed)``."""
    train = load(ds.dataset, ds.dataset_probs, ds.dataset_split, ds.max_samples, tokenizer, cfg, seed)
    evals = (
        load(ds.eval_dataset, None, ds.eval_split, None, tokenizer, cfg, seed) if ds.eval_dataset else None
    )
    return train, evals


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


def build_optimization(
    model: nn.Module,
    run_model: ModelConfig,
    optim: OptimConfig,
    dist_cfg: DistributedConfig,
    world: World,
    total_steps: int,
) -> Optimization:
    """Shard the model, then build AdamW, the schedule and the precision policy for it."""
    precision = Precision.create(run_model.param_dtype, world.device)
    model = parallelize(model, dist_cfg, world, precision.dtype)
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    guard = NonFiniteGuard(optim.max_nonfinite_steps)
    return Optimization(model, optimizer, scheduler, precision, optim.max_norm, guard)


def run_folder(run_dir: str | None, ckpt: CheckpointConfig) -> Path:
    """Where metrics and the run config go (``<save_path>/run`` unless the run names one)."""
    return Path(run_dir or Path(ckpt.save_path) / "run")


def trainer_kind(run) -> str:
    """``sft``, ``dpo``, ``kto``... from the run's class (``SFTRun``), recorded in its checkpoints."""
    return type(run).__name__.removesuffix("Run").lower()


def flat_config(run) -> dict:
    """The run's configs as one plain dict, recorded with the metrics."""
    return dict(asdict(run))


def seed_everything(train: TrainConfig) -> None:
    """Seed Python, numpy and torch; ``--full_determinism`` also forces deterministic kernels."""
    import os
    import random

    import numpy as np
    import torch

    random.seed(train.seed)
    np.random.seed(train.seed)
    torch.manual_seed(train.seed)
    if train.full_determinism:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False


def fit_run(
    run, objective, opt, tokenizer, world: World, train, evals, trainer_cls=None, **trainer_kwargs
) -> list[dict]:
    """Train ``objective`` with the run's train/checkpoint/logging configs; returns per-step metrics.

    ``trainer_cls`` is ``SupervisedTrainer`` or a subclass (reward models, KTO) with extra kwargs.
    """
    from tidal.trainers.loop import SupervisedTrainer

    trainer = (trainer_cls or SupervisedTrainer)(
        objective, opt, tokenizer, world, run.train, run.ckpt, run.logging, run_folder(run.run_dir, run.ckpt),
        run_config=flat_config(run), kind=trainer_kind(run), **trainer_kwargs,
    )  # fmt: skip
    return trainer.fit(train, evals)
