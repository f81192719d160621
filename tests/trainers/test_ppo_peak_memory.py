"""The RL trainer's per-step ``memory/peak_gb_rank<i>`` (read by ``bench/rl_placement.py``): logged on
CUDA only, so CPU histories keep their keys; the peak is reset after each reading."""

from __future__ import annotations

import pytest
import torch

from tidal.distributed.world import World
from tidal.trainers.ppo.trainer import peak_memory


def test_no_memory_metrics_on_the_cpu():
    assert peak_memory(World()) == {}


@pytest.mark.gpu
def test_peak_memory_per_rank_is_read_and_reset():
    world = World(device=torch.device("cuda", 0))
    torch.cuda.set_device(world.device)
    torch.cuda.reset_peak_memory_stats(world.device)
    block = torch.empty(2**30, dtype=torch.uint8, device=world.device)  # 1 GiB, freed before the reading
    del block
    first = peak_memory(world)
    assert list(first) == ["memory/peak_gb_rank0"] and first["memory/peak_gb_rank0"] >= 1.0
    assert peak_memory(world)["memory/peak_gb_rank0"] < 1.0  # the next step's peak starts afresh
