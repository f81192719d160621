"""A tiny trainable part (model, optimizer, scheduler) for checkpoint tests: what loops hand to checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Part:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object


def make_part(seed: int = 0, lr: float = 1e-3) -> Part:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return Part(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)))
