"""Frozen models: read by a trainer, never updated (the DPO/KTO and RL reference, reward models, the KD
teacher).

``FrozenModel`` is the one wrapper for all of them: no gradients, eval mode (no dropout), and with
``offload`` the weights live in CPU memory and visit the compute device only inside ``use()``, so a
frozen model never holds device memory while the policy's activations, gradients and optimizer state
do. (Precomputing its outputs once would be cheaper, but KTO's mismatched pairs depend on each epoch's
data order, KD needs full teacher distributions and RL scores fresh samples, so one mechanism serves
every role.)

``frozen_copy_config`` is how every frozen role loads its weights: full precision, no LoRA, no 4-bit,
no activation checkpointing; ``load_frozen`` loads one for a supervised trainer (sharded like the
policy unless offloaded).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from tidal.config.args import ConfigError
from tidal.config.distributed import DistributedConfig
from tidal.config.model import ModelConfig
from tidal.distributed.fsdp import parallelize
from tidal.distributed.world import World
from tidal.models.loading import load_causal_lm
from tidal.models.precision import resolve_dtype

CPU = torch.device("cpu")


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class FrozenModel:
    """A model without gradients; ``use()`` yields it on the compute device, in eval mode, under
    ``no_grad`` (with ``offload``: moved there for the block and back to CPU memory after it)."""

    def __init__(self, model: nn.Module, device: torch.device, offload: bool = False):
        self.model, self.device, self.offload = (
            model.requires_grad_(False).eval(),
            torch.device(device),
            offload,
        )
        if offload:
            self.model.to(CPU)

    @contextlib.contextmanager
    def use(self) -> Iterator[nn.Module]:
        if self.offload:
            self.model.to(self.device)
        try:
            with torch.no_grad(), eval_mode(self.model):
                yield self.model
        finally:
            if self.offload:
                self.model.to(CPU)


def frozen_copy_config(cfg: ModelConfig, path: str) -> ModelConfig:
    """The policy's model config for a frozen model at ``path``: stored in the policy's ``--master_dtype``
    (float32 by default; the same weights as the policy's at step 0), without LoRA, 4-bit quantisation or
    activation checkpointing (nothing is trained through it)."""
    return dataclasses.replace(
        cfg, pretrain=path, lora_rank=0, load_in_4bit=False, gradient_checkpointing=False
    )


def load_frozen(
    path: str, model_cfg: ModelConfig, offload: bool, dist_cfg: DistributedConfig, world: World, flag: str
) -> FrozenModel:
    """Load ``path`` (given by ``flag``) as a frozen causal LM next to a policy configured by
    ``model_cfg``; a bad folder is a one-line ``ConfigError`` naming the flag.

    Without offload it is sharded like the policy (all ranks run the same number of forwards);
    an offloaded copy stays whole on each rank, since it moves between CPU and device.
    """
    try:
        model = load_causal_lm(
            frozen_copy_config(model_cfg, path), CPU if offload else world.device, compute_device=world.device
        )
    except ConfigError as err:
        raise ConfigError(f"{flag} {path}: {err}") from err
    if not offload:
        model = parallelize(model, dist_cfg, world, resolve_dtype(model_cfg.param_dtype, world.device))
    return FrozenModel(model, world.device, offload)
