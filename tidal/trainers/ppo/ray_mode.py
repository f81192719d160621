"""Ray mode: ``tidal ppo`` with more than one policy worker starts them as Ray actors.

The driver (the ``ray job submit`` entry point, or any process) reserves one placement-group
bundle per worker (``tidal.distributed.ray_group``) and runs the rank's part of the same RL loop in
each (``run_ppo`` with torchrun's environment set), so the Ray path and the torchrun path share all
training code. Rank 0's per-rollout metrics come back to the driver. See ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import os

from tidal.logging import get_logger

log = get_logger(__name__)


def launched_by_torchrun() -> bool:
    """A launcher (torchrun, or a Ray worker of ours) already made this process one rank of a world."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1


def wants_ray(run) -> bool:
    return run.placement.actor_world_size > 1 and not launched_by_torchrun()


def _rank_main(run, ray_actors=None) -> list[dict]:
    from tidal.trainers.ppo.setup import run_ppo

    return run_ppo(run, ray_actors=ray_actors)


def run_ppo_ray(run) -> list[dict]:
    """Train with ``actor_num_nodes x actor_num_gpus_per_node`` data-parallel workers on Ray; roles on
    devices of their own (engines, reference, reward models) get actor groups and bundles of their own."""
    from tidal.distributed.ray_group import RayWorkerGroup
    from tidal.trainers.ppo.roles import role_totals

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
        return group.run(_rank_main, run, rank_args=[(a,) for a in rank_actors])[0]


def _role_group(run, role: str, count: int):
    """One Ray actor per worker of ``role``, each in a bundle of its own (a GPU, or a CPU)."""
    from tidal.distributed.ray_group import RayWorkerGroup
    from tidal.trainers.ppo.roles import role_spec
    from tidal.trainers.ppo.workers import WorkerActor

    name = "tidal-" + role.replace(" ", "-")
    group = RayWorkerGroup(count, name=name, actor_cls=WorkerActor, init_args=role_spec(run, role))
    log.info("Ray mode: %d %s workers (%s each) on %d node(s)", count, role, group.resources,
             len({node for node, _ in group.nodes}))  # fmt: skip
    return group
