"""Rollout/trainer mismatch correction.

The rollout engine samples with its own kernels (and often lower precision), so its log-probs
``rollout_logp`` differ from the trainer's ``old_logp`` for the same weights: the data is slightly
off-policy. The per-token importance weight ``w = exp(old_logp − rollout_logp)`` corrects that;
the correction multiplies the per-token policy loss (weights are detached, they are data).

One signature, chosen by name from ``MISMATCH_CORRECTIONS``::

    fn(old_logp, rollout_logp, action_mask, low, high) -> (weights [B, T], stats)

- ``tis``: truncated importance sampling, ``clamp(w, low, high)`` (Yao et al. 2025, "Your Efficient
  RL Framework Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl;
  the blog's truncation is ``min(w, C)`` with C = 2, i.e. ``low=0``).
- ``icepop``: masked importance sampling, ``w·1[low ≤ w ≤ high]``: tokens whose engines disagree too
  much get no gradient at all (Ling Team, IcePop in the Ring-1T report, arXiv 2510.18855; α=0.5, β=5).

Note: masked tokens still count in ``aggregate_loss``'s token normaliser; that keeps micro-batch
accumulation exact and matches "multiply the loss by the weight". ``stats`` report the fraction of
tokens truncated (tis) or masked (icepop) as ``mismatch_clip_ratio`` plus the mean weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tidal.algorithms.masked import masked_mean

LOG_WEIGHT_CLAMP = 20.0


def _importance_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    log_w = torch.where(
        mask, old_logp.float() - rollout_logp.float(), torch.zeros_like(old_logp, dtype=torch.float32)
    )
    return torch.exp(log_w.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)).detach()


@torch.no_grad()
def tis_weights(
    old_logp: Tensor, rollout_logp: Tensor, action_mask: Tensor, low: float = 0.0, high: float = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights ``clamp(w, low, high)``; 0 on masked positions."""
    mask = action_mask != 0
    w = _importance_weights(old_logp, rollout_logp, mask)
    outside = (w < low) | (w > high)
    weights = torch.where(mask, w.clamp(low, high), torch.zeros_like(w))
    return weights, {
        "mismatch_clip_ratio": masked_mean(outside.float(), mask),
        "mismatch_weight": masked_mean(w, mask),
    }


@torch.no_grad()
def icepop_weights(
    old_logp: Tensor, rollout_logp: Tensor, action_mask: Tensor, low: float = 0.5, high: float = 5.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance weights ``w·1[low ≤ w ≤ high]``; 0 on masked positions."""
    mask = action_mask != 0
    w = _importance_weights(old_logp, rollout_logp, mask)
    inside = (w >= low) & (w <= high)
    weights = torch.where(mask & inside, w, torch.zeros_like(w))
    return weights, {
        "mismatch_clip_ratio": masked_mean((~inside).float(), mask),
        "mismatch_weight": masked_mean(w, mask),
    }


MISMATCH_CORRECTIONS: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "tis": tis_weights,
    "icepop": icepop_weights,
}
