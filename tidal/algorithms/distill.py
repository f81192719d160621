"""Knowledge distillation loss (forward KL to the teacher, as in Hinton et al., arXiv 1503.02531).

Per token: ``(1 − α)·LM + α·(−Σ_v p_teacher(v) log p_student(v))``, where LM is the student's
cross-entropy on the labels. The distillation term is the cross-entropy to the teacher's
distribution (KL(p_t || p_s) plus the teacher's entropy, a constant for the student).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algorithms.sft import IGNORE_INDEX, loss_mask_from_labels, token_cross_entropy


def distillation_cross_entropy(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """−Σ_v p_teacher(v) log p_student(v) per position, float32; the teacher is treated as data.

    Vocabulary entries the student rules out (logit −inf, e.g. masked extra vocabulary) contribute 0
    instead of 0·(−inf) = nan; the teacher is expected to put no mass there.
    """
    teacher_probs = torch.softmax(teacher_logits.float(), dim=-1).detach()
    student_logprobs = torch.log_softmax(student_logits.float(), dim=-1)
    products = torch.where(
        torch.isinf(student_logprobs), torch.zeros_like(student_logprobs), teacher_probs * student_logprobs
    )
    return -products.sum(dim=-1)


def kd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor | None = None,
    alpha: float = 0.5,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Per-token ``(1 − α)·LM + α·KD`` ``[B, T]``, 0 on untrained positions (reduce with
    ``aggregate_loss`` and ``loss_mask_from_labels(labels, loss_mask)``)."""
    mask = loss_mask_from_labels(labels, loss_mask, ignore_index)
    lm = token_cross_entropy(student_logits, labels, loss_mask, ignore_index)
    kd = distillation_cross_entropy(student_logits, teacher_logits)
    per_token = (1 - alpha) * lm + alpha * kd
    return torch.where(mask, per_token, torch.zeros_like(per_token))
