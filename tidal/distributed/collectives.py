"""Statistics over all processes: the global versions of batch-wide reductions.

A data-parallel RL rank holds only its share of a rollout, so anything computed over the whole batch
(advantage whitening, reward normalisation, the adaptive KL's mean, logged means) must combine the
ranks' partial sums. Each function here is the identity of its single-process counterpart when the
world has one process, and matches it up to float rounding otherwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tidal.algorithms.masked import masked_mean, masked_sum
from tidal.distributed.world import World


def _comm_device(world: World) -> torch.device:
    return world.device if world.device.type == "cuda" else torch.device("cpu")


def all_reduce_tensor(values: Tensor, world: World, op=dist.ReduceOp.SUM) -> Tensor:
    """``values`` reduced over processes (float64 on the communication device; identity alone)."""
    t = values.detach().to(_comm_device(world), torch.float64).clone()
    if world.distributed:
        dist.all_reduce(t, op=op)
    return t


def max_over_world(value: int, world: World) -> int:
    return int(all_reduce_tensor(torch.tensor([value]), world, dist.ReduceOp.MAX).item())


def all_gather_objects(obj, world: World) -> list:
    """Every process's ``obj`` in rank order (picklable Python objects; small payloads only)."""
    if not world.distributed:
        return [obj]
    out: list = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_values(values: Tensor, world: World) -> Tensor:
    """A 1-D tensor concatenated over processes in rank order (e.g. a rollout's scalar rewards)."""
    parts = all_gather_objects(values.detach().cpu().reshape(-1), world)
    return torch.cat(parts[:: world.tp_size]).to(values.device)  # one copy per tensor-parallel group


def world_masked_mean(x: Tensor, mask: Tensor, world: World) -> float:
    """Mean of ``x`` over the masked entries of every process (0 when all are empty)."""
    if not world.distributed:
        return float(masked_mean(x, mask))
    sums = all_reduce_tensor(torch.stack([masked_sum(x, mask), masked_sum(torch.ones_like(x), mask)]), world)
    return float(sums[0] / sums[1]) if sums[1] > 0 else 0.0


def world_masked_whiten(x: Tensor, mask: Tensor, world: World, eps: float = 1e-8) -> Tensor:
    """``tidal.algorithms.masked_whiten`` with mean and population variance over every process (the
    variance floored at ``eps``, as there)."""
    mean = world_masked_mean(x, mask, world)
    var = world_masked_mean((x - mean).pow(2), mask, world)
    whitened = (x - mean) * torch.rsqrt(torch.tensor(max(var, eps), dtype=x.dtype, device=x.device))
    m = mask.to(x.dtype)
    return torch.where(m != 0, whitened * m, torch.zeros((), dtype=x.dtype, device=x.device))


def mean_over_world(stats: dict[str, float], world: World, weight: float = 1.0) -> dict[str, float]:
    """Per-key mean of scalar metrics over processes, each weighted by ``weight`` (e.g. its samples).

    Keys may differ between processes (an agent logs what it saw); a key's mean is over the
    processes that report it. With equal weights, a mean of per-sample means is the global mean.
    """
    if not world.distributed:
        return dict(stats)
    keys = sorted(set().union(*all_gather_objects(sorted(stats), world)))
    local = torch.tensor(
        [[float(stats[k]) * weight, weight] if k in stats else [0.0, 0.0] for k in keys], dtype=torch.float64
    ).reshape(len(keys), 2)
    total = all_reduce_tensor(local, world).cpu()
    return {k: float(s / w) for k, (s, w) in zip(keys, total.tolist(), strict=True) if w > 0}
