"""``Optimization``: a model being trained and what updates it (optimizer, schedule, precision policy,
clipping norm, non-finite guard), and ``build_optimization``, which shards a model and builds that stack.

Every trainer holds its trained models this way (the supervised loop, the PPO policy and critic, a critic
worker in a process of its own), so both live here, apart from the loop and the supervised recipe: a
module that loads no data and no trainer, which a critic worker imports alone. The optimizers and
schedules themselves are ``tidal.trainers.optim``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tidal.config import DistributedConfig, ModelConfig, OptimConfig
from tidal.distributed import World, parallelize
from tidal.models.linear_attention import check_linear_attention_training
from tidal.models.precision import Precision
from tidal.trainers.optim import NonFiniteGuard, build_optimizer, build_scheduler


@dataclass
class Optimization:
    """The model being trained and what updates it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Precision
    max_norm: float = 1.0
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)


def build_optimization(
    model: nn.Module,
    run_model: ModelConfig,
    optim: OptimConfig,
    dist_cfg: DistributedConfig,
    world: World,
    total_steps: int,
) -> Optimization:
    """Shard the model, then build the optimizer, the schedule and the precision policy for it."""
    check_linear_attention_training(model, world.device)  # before a run generates, not at its first backward
    precision = Precision.create(run_model.param_dtype, world.device)
    model = parallelize(model, dist_cfg, world, precision.dtype)
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    guard = NonFiniteGuard(optim.max_nonfinite_steps)
    return Optimization(model, optimizer, scheduler, precision, optim.max_norm, guard)
