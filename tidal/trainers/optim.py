"""AdamW and the learning-rate schedule shared by every trainer."""

from __future__ import annotations

import math

import torch
from torch import nn

from tidal.config.training import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (fused kernels on CUDA)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params,
        lr=lr or cfg.learning_rate,
        betas=tuple(cfg.adam_betas),
        weight_decay=cfg.l2,
        fused=fused or None,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warmup over ``lr_warmup_ratio`` of the steps, then the chosen decay."""
    from transformers import get_scheduler

    warmup = math.ceil(total_steps * cfg.lr_warmup_ratio)
    extra = {"min_lr_rate": cfg.min_lr_ratio} if cfg.lr_scheduler == "cosine_with_min_lr" else None
    return get_scheduler(
        cfg.lr_scheduler,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total_steps,
        scheduler_specific_kwargs=extra,
    )
