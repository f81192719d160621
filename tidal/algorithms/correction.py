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

``corrected_policy_loss`` applies a correction to a policy loss, as OpenRLHF's ``PolicyLoss`` does:

- token-ratio losses (``ppo``): per-token loss × the weights above;
- sequence-ratio losses (``gspo``): the sequence ratio is taken against the rollout engine's
  log-probs, ``s_i = exp(mean_t(log π_t − log π_rollout,t))``, and no token weight is applied; the
  ratio's own clip range bounds the correction, so the tis/icepop bounds do not enter. This is the
  GSPO paper's use of the inference engine's likelihoods (arXiv 2507.18071, "Benefit of GSPO for RL
  Infrastructure"): a sequence-level ratio tolerates token-level engine noise, while a product of
  token weights and a sequence ratio would mix two importance ratios at different granularities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tidal.algorithms.masked import masked_mean
from tidal.algorithms.policy_loss import POLICY_LOSSES, PolicyLossParams
from tidal.algorithms.registry import register

LOG_WEIGHT_CLAMP = 20.0


def _importance_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    log_w = torch.where(
        mask, old_logp.float() - rollout_logp.float(), torch.zeros_like(old_logp, dtype=torch.float32)
    )
    return torch.exp(log_w.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)).detach()


MISMATCH_CORRECTIONS: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}


@register(MISMATCH_CORRECTIONS, "tis")
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


@register(MISMATCH_CORRECTIONS, "icepop")
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


# Policy losses whose (sequence) ratio takes the rollout log-probs directly when correcting.
RATIO_AGAINST_ROLLOUT = frozenset({"gspo"})


def corrected_policy_loss(
    loss_type: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    params: PolicyLossParams,
    rollout_logp: Tensor | None = None,
    correction: str | None = None,
    bounds: tuple[float, float] = (0.5, 5.0),
) -> tuple[Tensor, dict[str, Tensor]]:
    """``POLICY_LOSSES[loss_type]`` with its own ``params`` (``ClipParams``, ``SapoParams``) and the
    mismatch ``correction`` (``tis``/``icepop``, None: off) applied as the module docstring says;
    ``(per_token_loss, stats)``."""
    loss_fn = POLICY_LOSSES[loss_type]
    own = params.kwargs()
    if correction is None:
        return loss_fn(logp, old_logp, advantages, action_mask, **own)
    if rollout_logp is None:
        raise ValueError(f"the {correction} correction needs the rollout engine's log-probs")
    if loss_type in RATIO_AGAINST_ROLLOUT:
        per_token, stats = loss_fn(logp, rollout_logp, advantages, action_mask, **own)
        mask = action_mask != 0
        stats["mismatch_weight"] = masked_mean(_importance_weights(old_logp, rollout_logp, mask), mask)
        return per_token, stats
    per_token, stats = loss_fn(logp, old_logp, advantages, action_mask, **own)
    weights, wstats = MISMATCH_CORRECTIONS[correction](old_logp, rollout_logp, action_mask, *bounds)
    return per_token * weights, stats | wstats
