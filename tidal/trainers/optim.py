"""AdamW, the learning-rate schedule and the non-finite step guard shared by every trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tidal.config.training import OptimConfig
from tidal.logging import get_logger

log = get_logger(__name__)


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


class NonFiniteError(RuntimeError):
    """Training diverged: too many optimizer steps in a row had a non-finite loss or gradient."""


# A step whose gradient is exactly zero while its loss is above this was not learning anything: the
# model overflowed inside (e.g. a huge learning rate pushed activations to inf before a norm layer,
# which then outputs zeros), so the loss stays put with finite but useless weights.
VANISHED_LOSS = 1e-6


def bad_step(
    loss: float, grad_norm: float, scaled: bool, flat: bool = False, into_outputs: float | None = None
) -> str | None:
    """Why an optimizer step must not be applied (None when it may). With fp16 loss scaling
    (``scaled``) an overflowing gradient is the scaler's business: it skips the step and lowers the
    scale, as it should in the first steps. ``flat``: the loss has no gradient with respect to any
    model output it reads (PPO's clipping, every token clipped), so a zero gradient is expected there.
    ``into_outputs``: the gradient the loss sends into those outputs, when the trainer measures it (PPO:
    ``tidal.trainers.ppo.update.OutputGradients``); a zero parameter gradient despite it means the model
    overflowed inside, whatever the loss (a PPO loss is near 0 by design: its advantages are centred)."""
    if not math.isfinite(loss):
        return f"a non-finite loss ({loss})"
    if not math.isfinite(grad_norm):
        return None if scaled else f"a non-finite gradient norm ({grad_norm})"
    if grad_norm != 0.0 or flat:
        return None
    if into_outputs is not None and into_outputs > 0:
        return (
            f"a zero gradient although the loss sends gradient into the model outputs ({into_outputs:.3g}): "
            "the model overflowed inside"
        )
    if abs(loss) > VANISHED_LOSS:
        return f"a zero gradient at loss {loss:.4g} (the model overflowed inside)"
    return None


@dataclass
class NonFiniteGuard:
    """Skips optimizer steps with a non-finite loss or gradient norm and counts them; ``limit``
    skipped steps in a row (``--max_nonfinite_steps``) stop training with ``NonFiniteError``.

    Every rank must take the same decision: the loss is all-reduced by the caller and FSDP's
    gradient norm is already global, so the inputs are identical on every rank."""

    limit: int = 3
    skipped: int = 0
    in_a_row: int = 0
    _loss: float = 0.0
    _flat: bool = False
    _into_outputs: float | None = None

    def observe_loss(self, loss: float, flat: bool = False, into_outputs: float | None = None) -> None:
        """The loss of the step about to be taken (summed over micro-batches, reduced over ranks),
        whether it is flat in the model outputs it reads on every rank, and the gradient it sends into
        them when measured (``bad_step``)."""
        self._loss, self._flat, self._into_outputs = loss, flat, into_outputs

    def take_loss(self) -> float:
        loss, self._loss = self._loss, 0.0
        return loss

    def allow(self, loss: float, grad_norm: float, scaled: bool = False) -> bool:
        """True when the step may be applied; otherwise counts it (raising at the limit)."""
        flat, self._flat = self._flat, False  # observed for this step only
        into_outputs, self._into_outputs = self._into_outputs, None
        reason = bad_step(loss, grad_norm, scaled, flat, into_outputs)
        if reason is None:
            if not (flat and grad_norm == 0.0):  # a flat step says nothing about the model: keep the count
                self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.in_a_row} optimizer steps in a row had {reason}: stopping (--max_nonfinite_steps "
                f"{self.limit}); try a lower --learning_rate, or check the data and rewards"
            )
        log.warning(
            "skipped an optimizer step with %s (%d in a row; --max_nonfinite_steps %d stops the run)",
            reason, self.in_a_row, self.limit,
        )  # fmt: skip
        return False

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.in_a_row = int(state.get("skipped", 0)), int(state.get("in_a_row", 0))
