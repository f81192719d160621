"""Process reward model (PRM) loss (step-level supervision, Lightman et al., arXiv 2305.20050).

Each reasoning step ends with a placeholder (step-marker) token; at those positions the model's
next-token logits are restricted to the reward-token ids (e.g. ``["+", "-"]``) and trained with
cross-entropy:

- hard labels (integer tensor): index into ``reward_token_ids`` (0 = first reward token);
- soft labels (float tensor): probability that the step is good, i.e. of the *first* (positive)
  reward token; needs exactly two reward tokens, target ``[p, 1 − p]``.

``labels`` is ``[B, T]`` and only read at ``placeholder_mask`` positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def _hard_targets(step_logits: Tensor, step_labels: Tensor) -> tuple[Tensor, Tensor]:
    loss = F.cross_entropy(step_logits, step_labels.long(), reduction="none")
    correct = step_logits.argmax(dim=-1) == step_labels.long()
    return loss, correct


def _soft_targets(step_logits: Tensor, step_labels: Tensor) -> tuple[Tensor, Tensor]:
    if step_logits.shape[-1] != 2:
        raise ValueError(f"soft PRM labels need exactly 2 reward tokens, got {step_logits.shape[-1]}")
    positive = step_labels.float()
    targets = torch.stack([positive, 1 - positive], dim=-1)
    loss = -(targets * torch.log_softmax(step_logits, dim=-1)).sum(dim=-1)
    correct = (step_logits[:, 0] >= step_logits[:, 1]) == (positive >= 0.5)
    return loss, correct


def prm_loss(
    logits: Tensor,
    placeholder_mask: Tensor,
    labels: Tensor,
    reward_token_ids: Sequence[int],
    num_steps: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``(loss, accuracy)``: summed cross-entropy over step positions / ``num_steps`` (default: the
    steps here; pass the optimizer step's count for exact gradient accumulation), and the fraction of
    steps whose most likely reward token matches the label (detached)."""
    selected = placeholder_mask.bool()
    step_logits = logits[selected][:, list(reward_token_ids)].float()
    step_labels = labels[selected]
    targets = _soft_targets if step_labels.is_floating_point() else _hard_targets
    loss, correct = targets(step_logits, step_labels)
    count = loss.numel() if num_steps is None else num_steps
    accuracy = correct.float().mean() if correct.numel() else torch.zeros((), device=logits.device)
    return loss.sum() / max(float(count), 1.0), accuracy.detach()
