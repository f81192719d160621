"""Preference losses: pairwise reward-model losses, DPO-family and KTO.

All inputs are per-sample (``[B]``); sequence log-probs are sums of token log-probs over the
response. Losses are returned per sample, so the caller chooses the normaliser (``.mean()`` or a
global count for gradient accumulation).

- ``RM_LOSSES`` — ``fn(chosen_rewards, rejected_rewards, margin=None) -> loss [B]``
  (Bradley–Terry; InstructGPT, arXiv 2203.02155; margin as in Llama 2, arXiv 2307.09288), computed
  in the rewards' dtype (the caller casts them: fp32 or the model's compute dtype).
- ``DPO_LOSSES`` — ``fn(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta,
  label_smoothing=0.0) -> (loss [B], chosen_rewards [B], rejected_rewards [B])`` with
  z = (π_c − π_r) − (ref_c − ref_r) and implicit rewards β·(π − ref) (detached).
- ``kto_loss`` with ``kto_kl_estimate`` (KTO, arXiv 2402.01306).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tidal.algorithms.registry import register

RM_LOSSES: dict[str, Callable[..., Tensor]] = {}
DPO_LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor]]] = {}


@register(RM_LOSSES, "sigmoid")
def sigmoid_pairwise_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None
) -> Tensor:
    """−log σ(r_c − r_r − margin), in the rewards' dtype (the caller picks it: ``--compute_fp32_loss``)."""
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    return -F.logsigmoid(diff)


@register(RM_LOSSES, "logexp")
def logexp_pairwise_loss(
    chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None
) -> Tensor:
    """log(1 + exp(r_r − r_c)), computed as softplus in the rewards' dtype. Mathematically the sigmoid
    loss without margin; kept for the seed's ``--loss logexp`` flag. It has no margin term (OpenRLHF's
    ``LogExpLoss`` ignores it), so ``--margin_loss`` with it is refused by the RM trainer."""
    return F.softplus(rejected_rewards - chosen_rewards)


def _dpo_logits(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    z = (policy_chosen.float() - policy_rejected.float()) - (ref_chosen.float() - ref_rejected.float())
    chosen_rewards = (beta * (policy_chosen.float() - ref_chosen.float())).detach()
    rejected_rewards = (beta * (policy_rejected.float() - ref_rejected.float())).detach()
    return z, chosen_rewards, rejected_rewards


@register(DPO_LOSSES, "sigmoid")
def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO (Rafailov et al., arXiv 2305.18290): −(1−ls)·log σ(βz) − ls·log σ(−βz).

    ``label_smoothing`` > 0 is conservative DPO (cDPO: labels flipped with probability ls).
    """
    z, chosen_rewards, rejected_rewards = _dpo_logits(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta
    )
    loss = -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    return loss, chosen_rewards, rejected_rewards


@register(DPO_LOSSES, "ipo")
def ipo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """IPO (Azar et al., arXiv 2310.12036): (z − 1/(2β))²; ``label_smoothing`` is unused."""
    z, chosen_rewards, rejected_rewards = _dpo_logits(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta
    )
    return (z - 1 / (2 * beta)).pow(2), chosen_rewards, rejected_rewards


def kto_kl_estimate(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """KTO's reference point: mean(π − ref) over *mismatched* (prompt, other completion) pairs,
    detached and clamped ≥ 0. All-reduce it across data-parallel ranks before ``kto_loss``."""
    return (policy_kl_logps.float() - ref_kl_logps.float()).mean().clamp(min=0).detach()


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl: Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """KTO (Ethayarajh et al., arXiv 2402.01306), per sample ``[B]``:

    desirable: w_d·(1 − σ(β(logratio − KL))); undesirable: w_u·(1 − σ(β(KL − logratio))), where
    logratio = π − ref. Returns ``(loss, rewards)`` with implicit rewards β·logratio (detached).
    """
    desirable = desirable.bool()
    logratio = policy_logps.float() - ref_logps.float()
    kl = kl.float().detach()
    desirable_loss = desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl)))
    undesirable_loss = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio)))
    loss = torch.where(desirable, desirable_loss, undesirable_loss)
    return loss, (beta * logratio).detach()
