"""Masked reductions over action tokens and loss aggregation.

Every per-token tensor in ``tidal.algorithms`` is batch-first, ``[B, T]`` over response (action)
positions, paired with an ``action_mask`` of the same shape (bool or 0/1; float weights also work).
Masked positions may hold garbage (``nan``/``inf`` from padding), so reductions select with
``torch.where`` rather than multiplying by the mask alone.

``aggregate_loss`` turns a per-token loss into the scalar the optimizer sees. Its explicit
normalisers (``num_tokens``/``num_sequences``: counts over the *whole optimizer step*) make gradient
accumulation exact: the sum of the micro-batch losses equals the loss of one big batch.
``aggregate_policy_loss`` adds per-token regularisers (KL loss, entropy bonus) as token means whatever
the policy loss's mode, as OpenRLHF does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tidal.algorithms.registry import register


def _masked_values(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` with exact zeros where the mask is 0, even if ``x`` is nan/inf there."""
    mask = mask.to(x.dtype)
    return torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over masked entries (all of them, or along ``dim``)."""
    values = _masked_values(x, mask)
    return values.sum() if dim is None else values.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked entries; 0 where the mask is empty (OpenRLHF's gives nan there)."""
    count = masked_sum(torch.ones_like(x), mask, dim)
    total = masked_sum(x, mask, dim)
    return torch.where(count > 0, total / count.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(total))


def masked_var(x: Tensor, mask: Tensor, dim: int | None = None, unbiased: bool = False) -> Tensor:
    """Variance of ``x`` over masked entries.

    ``unbiased=False`` (default) is the population variance (divide by N); ``unbiased=True`` applies
    Bessel's correction N/(N-1) and needs at least two masked entries.
    """
    mean = masked_mean(x, mask, dim)
    centred = x - (mean if dim is None else mean.unsqueeze(dim))
    var = masked_mean(centred.pow(2), mask, dim)
    if unbiased:
        count = masked_sum(torch.ones_like(x), mask, dim)
        var = var * count / (count - 1).clamp_min(1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Global whitening over all masked entries: ``(x - mean) / sqrt(max(var, eps))``.

    Uses the population variance over the masked entries of the whole tensor (the batch), as
    REINFORCE++ does; ``shift_mean=False`` adds the mean back (scale only). Masked entries become 0.
    The variance is floored at ``eps``, not shifted by it, as OpenRLHF's advantage normalisation
    (``var.clamp(min=1e-8).rsqrt()``): the two differ when the std is below ~1e-2.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var.clamp_min(eps))
    if not shift_mean:
        whitened = whitened + mean
    return _masked_values(whitened, mask)


def _normaliser(count: float | Tensor, like: Tensor) -> Tensor:
    # Counts of tokens/sequences; a count of 0 (empty batch) divides by 1 so the loss is 0, not nan.
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp_min(1)


# mode -> fn(per_token_loss, mask, num_tokens, num_sequences) -> scalar
LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {}


@register(LOSS_AGGREGATIONS, "token")
def _token_mean(loss: Tensor, mask: Tensor, num_tokens: float | None, num_sequences: float | None) -> Tensor:
    count = masked_sum(torch.ones_like(loss), mask) if num_tokens is None else num_tokens
    return masked_sum(loss, mask) / _normaliser(count, loss)


def _num_sequences(mask: Tensor, num_sequences: float | None) -> float | Tensor:
    # Default: the sequences of this batch that have at least one action token.
    return (mask != 0).any(dim=-1).sum() if num_sequences is None else num_sequences


@register(LOSS_AGGREGATIONS, "sequence")
def _sequence_mean(
    loss: Tensor, mask: Tensor, num_tokens: float | None, num_sequences: float | None
) -> Tensor:
    per_sequence = masked_mean(loss, mask, dim=-1)
    return per_sequence.sum() / _normaliser(_num_sequences(mask, num_sequences), loss)


@register(LOSS_AGGREGATIONS, "sequence_sum")
def _sequence_sum(
    loss: Tensor, mask: Tensor, num_tokens: float | None, num_sequences: float | None
) -> Tensor:
    per_sequence = masked_sum(loss, mask, dim=-1)
    return per_sequence.sum() / _normaliser(_num_sequences(mask, num_sequences), loss)


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: str = "token",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    - ``"token"``: sum over all action tokens / ``num_tokens`` (default: the action tokens here).
      Every token weighs the same, so long answers weigh more (PPO/DAPO default).
    - ``"sequence"``: sum over sequences of the per-sequence token mean / ``num_sequences``
      (default: sequences here with >= 1 action token). Every sequence weighs the same (GRPO paper).
    - ``"sequence_sum"``: per-sequence token *sums* averaged over sequences. Dividing that by a
      constant (the generation budget) gives Dr. GRPO's length-unbiased loss, arXiv 2503.20783.

    For gradient accumulation pass ``num_tokens``/``num_sequences`` counted over the whole optimizer
    step; the micro-batch losses then add up exactly to the big-batch loss.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {sorted(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[mode](per_token_loss, mask, num_tokens, num_sequences)


def aggregate_policy_loss(
    per_token_loss: Tensor,
    terms: list[Tensor],
    mask: Tensor,
    mode: str = "token",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> Tensor:
    """``aggregate_loss(per_token_loss, mode)`` plus the token mean of each per-token term in ``terms``
    (the KL loss, the entropy bonus: already signed and weighted).

    OpenRLHF averages those terms per token even when the policy loss is a per-sequence mean (GSPO);
    so does this. In ``"token"`` mode it is one token sum of ``loss + terms``, which adds up in the
    same float32 order as a trainer that sums the terms into the per-token loss first.
    """
    if mode == "token":
        for term in terms:
            per_token_loss = per_token_loss + term
        return aggregate_loss(per_token_loss, mask, "token", num_tokens)
    loss = aggregate_loss(per_token_loss, mask, mode, num_tokens, num_sequences)
    if terms:
        loss = loss + aggregate_loss(sum(terms), mask, "token", num_tokens)
    return loss
