"""Deterministic epoch order and per-step, per-rank sample indices.

The order of epoch ``e`` is a permutation drawn from a ``torch.Generator`` seeded with
``seed + e``, so it depends only on (n, seed, epoch): a resumed run rebuilds the same order and
skips exactly the ``k`` optimizer steps it already took (``step_batches(...)[k:]``), with no
sampler state to checkpoint.

Each optimizer step consumes ``global_batch`` consecutive indices of the permutation (the
``--train_batch_size``); rank ``r`` of ``world_size`` gets the contiguous slice
``[r * global_batch / world_size, (r + 1) * global_batch / world_size)`` of it (with tensor parallelism
the trainers pass the data-parallel rank and size: the tp ranks of a group share a slice). The incomplete last
step is dropped (``drop_last``): every step has the same number of samples, so losses and learning
rate schedules are comparable across steps, and at most ``global_batch - 1`` samples per epoch go
unseen (they are different ones each epoch).
"""

from __future__ import annotations

import torch

from tidal.data.errors import DataError


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The shuffled order of ``range(n)`` for ``epoch``."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


def steps_per_epoch(n: int, global_batch: int) -> int:
    """Number of full optimizer steps in one epoch (the incomplete last step is dropped)."""
    return n // global_batch


def step_batches(
    n: int, global_batch: int, seed: int, epoch: int, world_size: int = 1, rank: int = 0
) -> list[list[int]]:
    """For each optimizer step of ``epoch``, the sample indices of this rank's share."""
    if global_batch <= 0 or global_batch % world_size:
        raise DataError(
            f"global batch size {global_batch} must be a positive multiple of the world size {world_size}"
        )
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world size {world_size}")
    if n < global_batch:
        raise DataError(
            f"the dataset has {n} sample(s), fewer than one global batch of {global_batch}; "
            "lower --train_batch_size or add data"
        )
    order = epoch_permutation(n, seed, epoch)
    share = global_batch // world_size
    return [
        order[step * global_batch + rank * share : step * global_batch + (rank + 1) * share]
        for step in range(steps_per_epoch(n, global_batch))
    ]


def micro_batches(indices: list[int], micro_batch: int) -> list[list[int]]:
    """Split one rank's step share into micro-batches (gradient accumulation); the last may be short."""
    if micro_batch <= 0:
        raise DataError(f"micro batch size must be positive, got {micro_batch}")
    return [indices[i : i + micro_batch] for i in range(0, len(indices), micro_batch)]


def contiguous_splits(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges covering ``range(count)``; sizes differ by at most
    one, the earlier ranges taking the remainder."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds
