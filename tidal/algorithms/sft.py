"""Token-level language-modelling loss (SFT; also the NLL term of DPO and KD).

``token_cross_entropy(logits, labels, loss_mask=None)`` returns the per-token negative log-likelihood
``[B, T]`` (0 where masked or ``labels == ignore_index``); reduce it with ``masked.aggregate_loss``
(token-level by default) using the same mask. ``logits[:, t]`` must already be aligned with
``labels[:, t]`` (shift by one for next-token prediction).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidal.algorithms.logprobs import gather_logprobs

IGNORE_INDEX = -100


def loss_mask_from_labels(
    labels: Tensor, loss_mask: Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Bool mask of positions that are trained: ``labels != ignore_index`` and ``loss_mask``."""
    mask = labels != ignore_index
    return mask if loss_mask is None else mask & (loss_mask != 0)


def token_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    loss_mask: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> Tensor:
    """Per-token −log softmax(logits)[label], float32, 0 on untrained positions."""
    mask = loss_mask_from_labels(labels, loss_mask, ignore_index)
    safe_labels = torch.where(mask, labels, torch.zeros_like(labels))
    nll = -gather_logprobs(logits, safe_labels, chunk_size=chunk_size)
    return torch.where(mask, nll, torch.zeros_like(nll))
