"""Ray mode: ``tidal ppo`` with more than one policy worker starts them as Ray actors.

The driver (the ``ray job submit`` entry point, or any process) reserves one placement-group
bundle per worker (``tidal.distributed.ray_group``) and runs the rank's part of the same RL loop in
each (the ``rank_main`` it is given, with torchrun's environment set), so the Ray path and the
torchrun path share all training code. Roles on devices of their own (engines, reference, reward
models) get actor groups of their own; each rank receives its share of their actors. Rank 0's
per-rollout metrics come back to the driver. See ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from tidal.config import ConfigError
from tidal.distributed.ray_group import RayWorkerGroup
from tidal.logging import get_logger
from tidal.placement.protocols import PlacedRun
from tidal.placement.roles import role_spec, role_totals
from tidal.placement.workers import WorkerActor

log = get_logger(__name__)


def launched_by_torchrun() -> bool:
    """A launcher (torchrun, or a Ray worker of ours) already made this process one rank of a world."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1


def wants_ray(run: PlacedRun) -> bool:
    """More than one policy worker and no launcher started this process: the driver places them on Ray."""
    return run.placement.actor_world_size > 1 and not launched_by_torchrun()


def run_on_ray(run: PlacedRun, rank_main: Callable[[PlacedRun, dict], list[dict]]) -> list[dict]:
    """``rank_main(run, actors)`` on ``actor_num_nodes x actor_num_gpus_per_node`` data-parallel Ray
    workers (``actors``: that rank's separate workers per role); rank 0's result. ``rank_main`` must
    be a module-level function (Ray sends it to the workers by name)."""
    world_size = run.placement.actor_world_size
    with contextlib.ExitStack() as stack:
        rank_actors: list[dict] = [{} for _ in range(world_size)]
        for role, total in role_totals(run).items():
            if total:
                actors = stack.enter_context(_role_group(run, role, total)).actors
                per_rank = total // world_size
                for r in range(world_size):
                    rank_actors[r][role] = actors[r * per_rank : (r + 1) * per_rank]
        group = stack.enter_context(RayWorkerGroup(world_size))
        nodes = {node for node, _ in group.nodes}
        log.info("Ray mode: %d policy workers (%s each) on %d node(s); rank 0 at %s", world_size,
                 group.resources, len(nodes), group.nodes[0][1])  # fmt: skip
        return group.run(rank_main, run, rank_args=[(a,) for a in rank_actors])[0]


def _role_group(run: PlacedRun, role: str, count: int) -> RayWorkerGroup:
    """One Ray actor per worker of ``role``, each in a bundle of its own (a GPU, or a CPU)."""
    tp = run.rollout.vllm_tensor_parallel_size
    if role == "engine" and tp > 1:  # a Ray engine actor holds a one-device bundle
        raise ConfigError(
            f"--vllm_tensor_parallel_size {tp} in Ray mode: each engine actor gets one device; tensor-parallel "
            "engines run in local mode or under torchrun (engine processes started by each trainer)"
        )
    name = "tidal-" + role.replace(" ", "-")
    group = RayWorkerGroup(count, name=name, actor_cls=WorkerActor, init_args=role_spec(run, role))
    log.info("Ray mode: %d %s workers (%s each) on %d node(s)", count, role, group.resources,
             len({node for node, _ in group.nodes}))  # fmt: skip
    return group
