"""Ray mode: ``tidal ppo`` with more than one policy worker starts them as Ray actors.

The driver (the ``ray job submit`` entry point, or any process) reserves one placement-group
bundle per worker (``tidal.distributed.ray_group``) and runs the rank's part of the same RL loop in
each (the ``rank_main`` it is given, with torchrun's environment set), so the Ray path and the
torchrun path share all training code. Roles on devices of their own (engines, reference, reward
models) get actor groups of their own; each rank receives its share of their actors. A
tensor-parallel engine (``--vllm_tensor_parallel_size N``) is one actor in a bundle of N devices: it
is the engine's rank 0 and starts ranks 1..N-1 inside the bundle as local mode does
(``tidal.rollout.runner.tp_worker``), so weight sync and generation are those of a separate engine process.
Engines colocated with the policy workers need no actors: they live in the workers (an engine spanning
N of them through sub-groups of the training world). Rank 0's per-rollout metrics come back to the
driver. See ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from tidal.config import ConfigError
from tidal.distributed.ray_group import RayWorkerGroup, connect
from tidal.logging import get_logger
from tidal.placement.protocols import PlacedRun
from tidal.placement.roles import FLAGS, role_spec, role_totals
from tidal.placement.workers import WorkerActor

log = get_logger(__name__)

CLOSE_TIMEOUT_S = 60


def launched_by_torchrun() -> bool:
    """A launcher (torchrun, or a Ray worker of ours) already made this process one rank of a world."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1


def wants_ray(run: PlacedRun) -> bool:
    """More than one policy worker and no launcher started this process: the driver places them on Ray."""
    return run.placement.actor_world_size > 1 and not launched_by_torchrun()


def run_on_ray(run: PlacedRun, rank_main: Callable[[PlacedRun, dict], list[dict]]) -> list[dict]:
    """``rank_main(run, actors)`` on ``actor_num_nodes x actor_num_gpus_per_node`` data-parallel Ray
    workers (``actors``: that rank's separate workers per role); rank 0's result. ``rank_main`` must
    be a module-level function (Ray sends it to the workers by name). A layout the cluster can never
    hold fails first, in one line (``ray_layout_problem``)."""
    world_size = run.placement.actor_world_size
    connect()
    if problem := ray_layout_problem(run, *cluster_devices()):
        raise ConfigError(problem)
    with contextlib.ExitStack() as stack:
        rank_actors: list[dict] = [{} for _ in range(world_size)]
        for role, total in role_totals(run).items():
            if total:
                actors = stack.enter_context(_role_group(run, role, total)).actors
                stack.callback(close_actors, actors)  # before the group's exit kills them (LIFO)
                per_rank = total // world_size
                for r in range(world_size):
                    rank_actors[r][role] = actors[r * per_rank : (r + 1) * per_rank]
        group = stack.enter_context(RayWorkerGroup(world_size))
        nodes = {node for node, _ in group.nodes}
        log.info("Ray mode: %d policy workers (%s each) on %d node(s); rank 0 at %s", world_size,
                 group.resources, len(nodes), group.nodes[0][1])  # fmt: skip
        return group.run(rank_main, run, rank_args=[(a,) for a in rank_actors])[0]


def bundle_devices(run: PlacedRun, role: str) -> int:
    """Devices in one bundle of ``role``: a tensor-parallel engine's N, else one."""
    return run.rollout.vllm_tensor_parallel_size if role == "engine" else 1


def cluster_devices() -> tuple[str, list[float]]:
    """("GPU" or "CPU", how many of them each live node of the cluster has): GPUs where the cluster has
    any (as ``ray_group.bundle_resources`` places), else CPUs."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    kind = "GPU" if any(r.get("GPU", 0) > 0 for r in nodes) else "CPU"
    return kind, [r.get(kind, 0.0) for r in nodes]


def ray_layout_problem(run: PlacedRun, kind: str, per_node: list[float]) -> str | None:
    """The one-line reason a cluster with ``per_node`` devices of ``kind`` can never place this run's
    bundles (a tensor-parallel engine's N devices must share a node), or None."""
    w, tp = run.placement.actor_world_size, run.rollout.vllm_tensor_parallel_size
    totals = {role: n for role, n in role_totals(run).items() if n}
    largest = max(per_node, default=0.0)
    if "engine" in totals and tp > largest:
        return (
            f"--vllm_tensor_parallel_size {tp} in Ray mode: each engine is one placement-group bundle of {tp} "
            f"{kind}s on one node, but the largest node of the cluster has {largest:g}"
        )
    needed = w + sum(n * bundle_devices(run, role) for role, n in totals.items())
    if needed <= sum(per_node):
        return None
    parts = [f"{w} policy workers (--actor_num_nodes x --actor_num_gpus_per_node)"]
    for role, n in totals.items():
        per = bundle_devices(run, role)
        size = f" x {per} (--vllm_tensor_parallel_size)" if per > 1 else ""
        parts.append(f"{n} {role} workers ({FLAGS[role]}){size}")
    return f"Ray mode needs {needed} {kind}s for {' + '.join(parts)}; the cluster has {sum(per_node):g}"


def close_actors(actors: list) -> None:
    """Let each worker release what Ray did not start (a tensor-parallel engine's rank processes) before
    the actors are killed (which runs no exit hooks); an actor already gone is skipped."""
    import ray

    refs = [a.close.remote() for a in actors]
    for ref in refs:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(ref, timeout=CLOSE_TIMEOUT_S)


def _role_group(run: PlacedRun, role: str, count: int) -> RayWorkerGroup:
    """One Ray actor per worker of ``role``, each in a bundle of its own: one device, or a tensor-parallel
    engine's N (its process is rank 0 and starts the other N-1 in the bundle, as in local mode)."""
    name = "tidal-" + role.replace(" ", "-")
    spec, devices = role_spec(run, role), bundle_devices(run, role)
    group = RayWorkerGroup(count, name=name, actor_cls=WorkerActor, init_args=spec, devices=devices)
    log.info("Ray mode: %d %s workers (%s each) on %d node(s)", count, role, group.resources,
             len({node for node, _ in group.nodes}))  # fmt: skip
    return group
