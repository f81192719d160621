"""Collate ``SFTSample``s into padded or packed micro-batches.

Loss-mask alignment (the one convention every trainer relies on):

    loss_mask[t] == 1  <=>  token t is a target, predicted by the logits at position t - 1.

So the trainer computes ``logits[:, :-1]`` against ``input_ids[:, 1:]`` weighted by
``loss_mask[:, 1:]`` (or uses ``next_token_targets`` below, which does that shift). The first token
of every sample has ``loss_mask == 0`` (the builders guarantee it and both collators enforce it),
so in a packed row the last token of sample i never learns to predict the first token of sample
i + 1.

``collate_padded`` → ``input_ids``, ``attention_mask``, ``loss_mask``, ``position_ids``: LongTensors
``[B, T]``, right-padded with ``pad_id`` (mask 0, position 0 on padding).

``collate_packed`` → one row holding every sample back to back (``--packing_samples``):
``input_ids``, ``loss_mask``, ``position_ids`` (restarting at 0 per sample), ``segment_ids``
(0,0,..,1,1,..) as LongTensors ``[1, ΣT]``; ``seq_lens`` (LongTensor ``[B]``) and ``cu_seqlens``
(int32 ``[B + 1]``, flash-attention varlen style). There is no ``attention_mask``: the model side
must forbid attention across samples (block-diagonal causal mask from ``segment_ids``, or varlen
kernels from ``cu_seqlens``).

Samples with images (vision-language models) add ``pixel_values``, ``image_grid_thw`` and
``image_counts`` to either kind (``tidal.data.vision.image_batch``).
"""

from __future__ import annotations

import torch

from tidal.data.sft import SFTSample
from tidal.data.vision import image_batch

IGNORE_INDEX = -100


def collate_padded(samples: list[SFTSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch to its longest sample."""
    _check(samples)
    width = max(len(s) for s in samples)
    batch = {
        "input_ids": torch.full((len(samples), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(samples), width), dtype=torch.long),
        "loss_mask": torch.zeros((len(samples), width), dtype=torch.long),
        "position_ids": torch.zeros((len(samples), width), dtype=torch.long),
    }
    for row, sample in enumerate(samples):
        n = len(sample)
        batch["input_ids"][row, :n] = torch.tensor(sample.input_ids)
        batch["attention_mask"][row, :n] = 1
        batch["loss_mask"][row, 1:n] = torch.tensor(sample.loss_mask[1:])
        batch["position_ids"][row, :n] = torch.arange(n)
    return {**batch, **image_batch(samples)}


def collate_packed(samples: list[SFTSample], pad_id: int | None = None) -> dict[str, torch.Tensor]:
    """Concatenate a micro-batch into one row; ``pad_id`` is unused (kept so collators swap freely)."""
    _check(samples)
    lens = torch.tensor([len(s) for s in samples], dtype=torch.long)
    loss_mask = torch.cat([torch.tensor([0] + s.loss_mask[1:], dtype=torch.long) for s in samples])
    return {
        "input_ids": torch.cat([torch.tensor(s.input_ids, dtype=torch.long) for s in samples])[None],
        "loss_mask": loss_mask[None],
        "position_ids": torch.cat([torch.arange(n) for n in lens.tolist()])[None],
        "segment_ids": torch.repeat_interleave(torch.arange(len(samples)), lens)[None],
        "seq_lens": lens,
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32),
        **image_batch(samples),
    }


def next_token_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Targets aligned with the logits: ``targets[..., t] = input_ids[..., t + 1]`` where trained.

    Positions whose next token is not a target (and the last position) hold ``ignore_index``, so
    ``cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=...)`` is the SFT loss.
    """
    targets = torch.full_like(input_ids, ignore_index)
    shifted = input_ids[..., 1:]
    targets[..., :-1] = torch.where(
        loss_mask[..., 1:].bool(), shifted, torch.full_like(shifted, ignore_index)
    )
    return targets


def _check(samples: list[SFTSample]) -> None:
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    for s in samples:
        if len(s.input_ids) != len(s.loss_mask) or not s.input_ids:
            raise ValueError(
                f"sample from row {s.row}: input_ids and loss_mask must be non-empty and equal length"
            )
