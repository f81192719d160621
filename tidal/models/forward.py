"""Forward passes over padded or packed batches, and per-token log-probs of the input tokens.

Batches come from ``tidal.data.collate``: padded batches carry a 2-D ``attention_mask``; packed
batches put several samples in one row and carry ``segment_ids``, from which we build a
block-diagonal causal mask so that no token attends across a sample boundary (position ids
restart per sample, so RoPE sees each sample as if it were alone).
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.algorithms.logprobs import gather_logprobs


def packed_attention_mask(segment_ids: torch.Tensor, additive: bool = False) -> torch.Tensor:
    """[B, 1, T, T] mask: causal within a segment, blocked across segments.

    Boolean (True = may attend) for ``sdpa``; ``eager`` attention adds the mask to the scores, so it
    gets a float32 additive mask instead.
    """
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (causal & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]
    if not additive:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=segment_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)


def model_inputs(model: nn.Module, batch: dict) -> dict:
    """Keyword arguments for a HF model's forward from a collated batch."""
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if "segment_ids" in batch:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
        kwargs["attention_mask"] = packed_attention_mask(batch["segment_ids"], additive=impl == "eager")
    else:
        kwargs["attention_mask"] = batch["attention_mask"]
    return kwargs


def token_logprobs(model: nn.Module, batch: dict, temperature: float = 1.0, **forward_kwargs):
    """Per-token log p(token_t | tokens_<t) aligned with ``input_ids`` ([B, T]; position 0 is 0).

    Returns ``(logprobs, outputs)`` so callers can also use e.g. ``outputs.aux_loss``.
    """
    outputs = model(**model_inputs(model, batch), use_cache=False, **forward_kwargs)
    ids = batch["input_ids"]
    lp = gather_logprobs(outputs.logits[:, :-1], ids[:, 1:], temperature)
    return torch.cat([lp.new_zeros(ids.shape[0], 1), lp], dim=1), outputs
