"""The optimizer (AdamW, or Muon + AdamW), the learning-rate schedule and the non-finite step guard shared
by every trainer.

``--optim muon`` (OpenRLHF's name) trains the 2-D weights of the model's hidden linear layers with
``torch.optim.Muon`` (momentum orthogonalised by Newton-Schulz iterations) and everything else with
AdamW: embeddings, output heads (the LM head, a value/reward head), norms and biases, as Muon's authors
recommend. Muon takes ``--muon_lr``, ``--muon_momentum``, ``--muon_ns_steps``, ``--muon_nesterov`` and
the weight decay ``--l2``; the AdamW part takes the AdamW flags (``--learning_rate``, ``--adam_betas``,
``--adam_eps``, ``--l2``), as OpenRLHF's Muon does. Both are one ``MuonWithAdamW`` optimizer, so the
schedule (which scales each group's own peak rate), gradient clipping, loss scaling and checkpoints see
one optimizer with both kinds of parameter group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tidal.config.args import ConfigError
from tidal.config.training import OptimConfig
from tidal.logging import get_logger

log = get_logger(__name__)


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (fused kernels on CUDA); with ``--optim muon``, Muon for the
    hidden matrices (``muon_split``) and AdamW for the rest, as one ``MuonWithAdamW``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    if cfg.optim == "muon":
        hidden, rest = muon_split(model)
        if hidden:
            return MuonWithAdamW(muon_optimizer(hidden, cfg), adamw(rest, cfg, lr) if rest else None)
        log.warning("--optim muon: the model has no trainable hidden matrices; every parameter uses AdamW")
    return adamw(params, cfg, lr)


def adamw(params: list[nn.Parameter], cfg: OptimConfig, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW with the run's AdamW flags (fused kernels when every parameter is on CUDA)."""
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params,
        lr=lr or cfg.learning_rate,
        betas=tuple(cfg.adam_betas),
        eps=cfg.adam_eps,
        weight_decay=cfg.l2,
        fused=fused or None,
    )


def muon_optimizer(params: list[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """``torch.optim.Muon`` with the run's Muon flags (weight decay: ``--l2``, as OpenRLHF's Muon)."""
    if any(getattr(p, "device_mesh", None) is not None and p.device_mesh.size() > 1 for p in params):
        raise ConfigError(
            "--optim muon orthogonalises whole weight matrices, which FSDP2 shards across ranks: tidal runs "
            "Muon on one rank (one process per model) only; use --optim adam with several ranks"
        )
    return torch.optim.Muon(
        params,
        lr=cfg.muon_lr,
        weight_decay=cfg.l2,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
    )


def _head_modules(model: nn.Module) -> set[nn.Module]:
    """The model's output heads: its output embeddings (LM head) and its value/reward head, if any."""
    heads = set()
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if isinstance(output, nn.Module):
        heads.add(output)
    prefix = getattr(model, "value_head_prefix", None)
    head = getattr(model, prefix, None) if isinstance(prefix, str) else None
    if isinstance(head, nn.Module):
        heads.add(head)
    return heads


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden, rest): the trainable 2-D weights of linear layers that are not output heads (Muon's),
    and every other trainable parameter: embeddings, heads, norms, biases (AdamW's). A weight tied to
    the embeddings counts as an embedding."""
    heads = _head_modules(model)
    not_hidden = {
        id(p) for m in model.modules() if m in heads or isinstance(m, nn.Embedding) for p in m.parameters()
    }
    hidden, rest, seen = [], [], set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            is_hidden = isinstance(module, nn.Linear) and name == "weight" and p.ndim == 2
            (hidden if is_hidden and id(p) not in not_hidden else rest).append(p)
    return hidden, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over Muon's parameter groups and AdamW's: each group keeps its own hyperparameters
    (and a ``muon`` tag); ``step`` runs each kind's torch optimizer over its groups. The groups and the
    per-parameter state live here (what the schedule, ``state_dict`` and DCP checkpoints read), and the
    two inner optimizers are pointed at them before every step (``load_state_dict`` replaces both)."""

    def __init__(self, muon: torch.optim.Optimizer, adam: torch.optim.Optimizer | None):
        self._inner = [(True, muon)] + ([(False, adam)] if adam is not None else [])
        groups = [dict(group, muon=tag) for tag, inner in self._inner for group in inner.param_groups]
        super().__init__(groups, defaults={})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for tag, inner in self._inner:
            inner.param_groups = [group for group in self.param_groups if group["muon"] == tag]
            inner.state = self.state  # keyed by parameter; the two kinds never share one
            inner.step()
        return loss


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
