"""Process groups that split the world along more than one axis: ring-attention groups.

``--ring_attn_size N`` cuts the world into groups of N consecutive ranks (ranks 0..N-1, N..2N-1, ...);
each group runs ring attention over a packed row that all of its ranks hold
(``tidal.models.ring_attention``). ``ring_layout_problems`` is the check that runs before any model
loads. ``RingGroup`` (this rank's group) is the type ``tidal.models.ring_attention`` computes over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tidal.config.distributed import ring_layout_problems as ring_layout_problems
from tidal.distributed.world import World


@dataclass(frozen=True)
class RingGroup:
    """This rank's ring: the process group, its place in it and the global ranks in ring order."""

    group: Any  # a torch.distributed ProcessGroup
    rank: int
    size: int
    ranks: tuple[int, ...]
    head_stride: int = 1

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


def ring_group(world: World, size: int, head_stride: int = 1) -> RingGroup | None:
    """This rank's ring group of ``size`` consecutive ranks (None when ``size`` is 1). Every rank must
    call it (each group is created by all ranks, in order)."""
    if size <= 1:
        return None
    problems = ring_layout_problems(size, world.world_size)
    if problems:
        raise ValueError(problems[0])
    mine = None
    for first in range(0, world.world_size, size):
        ranks = tuple(range(first, first + size))
        group = dist.new_group(list(ranks))
        if world.rank in ranks:
            mine = RingGroup(group, ranks.index(world.rank), size, ranks, head_stride)
    return mine
