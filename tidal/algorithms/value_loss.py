"""Critic (value) loss for PPO with GAE (Schulman et al., arXiv 1707.06347).

``value_loss(values, old_values, returns, action_mask, clip_eps=None) -> (per_token_loss, stats)``:
``0.5·max((V_old + clip(V − V_old, ±ε) − G)², (V − G)²)`` per action token, or ``0.5·(V − G)²``
without clipping (``clip_eps=None``). Reduce with ``masked.aggregate_loss``. The entropy bonus lives
in ``logprobs.entropy_from_logits``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algorithms.masked import masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    clip_eps: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token (optionally clipped) squared error; 0 on masked positions.

    ``stats["value_clip_ratio"]``: fraction of tokens where the clipped term is the larger one.
    """
    mask = action_mask != 0
    values = values.float()
    returns = returns.float()
    unclipped = (values - returns).pow(2)
    if clip_eps is None:
        loss = 0.5 * unclipped
        clipped_larger = torch.zeros_like(mask)
    else:
        old_values = old_values.float()
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (values_clipped - returns).pow(2)
        loss = 0.5 * torch.max(unclipped, clipped)
        clipped_larger = clipped > unclipped
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    return loss, {"value_clip_ratio": masked_mean(clipped_larger.float(), mask).detach()}
