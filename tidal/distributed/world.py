"""Process and device setup: one process per device, launched by torchrun or Ray, or a single process.

``init_world()`` reads the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), picks
the device (``cuda:LOCAL_RANK`` when CUDA exists, else the CPU) and, with more than one process,
initialises the default process group (NCCL on CUDA, gloo on CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """Where this process sits: its rank among ``world_size`` processes and its device.

    With tensor parallelism (``tidal.distributed.tensor_parallel``) the ``tp_size`` consecutive ranks of
    one data-parallel group train on the same batch: data is sharded by ``dp_rank`` of ``dp_size``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    tp_size: int = 1

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group (its batch share)."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        """The number of data-parallel groups (distinct batch shares)."""
        return self.world_size // self.tp_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_world(device: str | None = None) -> World:
    """Set up this process's device and, when launched with several processes, the process group."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world_size, device_id=dev if dev.type == "cuda" else None
        )
    return World(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def all_reduce_sum(value: float | int, world: World) -> float:
    """Sum a Python number over all processes (identity with one process)."""
    if not world.distributed:
        return float(value)
    t = torch.tensor(
        [float(value)], dtype=torch.float64, device=world.device if world.device.type == "cuda" else "cpu"
    )
    dist.all_reduce(t)
    return float(t.item())


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def shutdown(world: World) -> None:
    """Tear the process group down once every rank got here (a rank destroying it while another
    still has work in flight can abort the process at exit)."""
    if world.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
