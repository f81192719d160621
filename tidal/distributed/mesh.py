"""Process groups that split the world along more than one axis: ring-attention groups.

``--ring_attn_size N`` cuts the world into groups of N consecutive ranks (ranks 0..N-1, N..2N-1, ...);
each group runs ring attention over a packed row that all of its ranks hold
(``tidal.models.ring_attention``). ``ring_layout_problems`` is the check that runs before any model
loads.
"""

from __future__ import annotations

import torch.distributed as dist

from tidal.config.distributed import ring_layout_problems as ring_layout_problems
from tidal.distributed.world import World
from tidal.models.ring_attention import RingGroup


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
