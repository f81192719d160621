"""``--enable_ema``: an exponential moving average of the policy's weights (OpenRLHF v0.9.2's EMA model).

After every optimizer step of the policy, each trained weight's average moves towards it:
``ema ← β·ema + (1 − β)·w`` (β = ``--ema_beta``), starting from the initial weights, so after k
steps ``ema_k = β^k·w_0 + (1 − β)·Σ_{i=1..k} β^{k−i}·w_i``. Only the average is what the run
saves as its model (``--save_path``, and ``--save_hf_ckpt`` copies), as OpenRLHF does; the policy
itself keeps training and generating. Frozen weights (a LoRA's base) are not averaged: they never
move.

The average is a copy of each parameter as the trainer holds it: under FSDP2 every rank keeps the
average of its own shards (no gathering), on one device it is the whole tensor. It is saved in the
resumable checkpoint (each rank its shards) and restored on resume, so a resumed run averages
exactly as an uninterrupted one; a checkpoint written without it restarts the average from the
restored weights.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from tidal.config import ConfigError


def _local(t: Tensor) -> Tensor:
    """This rank's part of a (possibly FSDP2-sharded, ``DTensor``) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class PolicyEMA:
    """The moving average of ``model``'s trained parameters (see the module docstring)."""

    def __init__(self, model: nn.Module, beta: float):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"ema_beta must be in [0, 1], got {beta}")
        self.beta = beta
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.average = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, after an optimizer step: ``ema ← β·ema + (1 − β)·w``."""
        for avg, p in zip(self.average, self.params, strict=True):
            avg.mul_(self.beta).add_(p.detach(), alpha=1.0 - self.beta)

    @torch.no_grad()
    def _swap(self) -> None:
        for avg, p in zip(self.average, self.params, strict=True):
            held = p.detach().clone()
            p.detach().copy_(avg)
            avg.copy_(held)

    @contextmanager
    def swapped_in(self):
        """The model holds the averaged weights inside the block (to save them), its own after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def state_dict(self) -> dict:
        return {"beta": self.beta, "average": [_local(a).detach().cpu() for a in self.average]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a saved average; an empty state (a checkpoint written without ``--enable_ema``)
        restarts it from the model's (restored) weights."""
        saved = (state or {}).get("average")
        if saved is None:
            for avg, p in zip(self.average, self.params, strict=True):
                avg.copy_(p.detach())
            return
        shapes = [tuple(_local(a).shape) for a in self.average]
        if [tuple(t.shape) for t in saved] != shapes:
            raise ConfigError(
                "--enable_ema: the checkpoint's EMA weights do not match this run's policy shards (was it "
                "written by another model or another number of processes?)"
            )
        for avg, value in zip(self.average, saved, strict=True):
            _local(avg).copy_(value)
