"""Ray worker groups: one actor per placement-group bundle, each one rank of a torch process group.

``RayWorkerGroup(world_size)`` reserves a placement group of ``world_size`` bundles — ``{"GPU": 1}``
on a cluster with GPUs, else ``{"CPU": 1}`` — and starts one ``RankWorker`` actor in each. ``run(fn,
*args)`` calls ``fn`` on every actor with the launcher environment torchrun would set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``fn`` sets itself up with
``tidal.distributed.init_world()`` exactly as under torchrun: both launchers share all code below.
Other actors placed the same way (rollout engines) pass their class as ``actor_cls``, and ``devices``
per bundle when one actor holds several (a tensor-parallel engine).
Ray is an optional dependency (``pip install 'tidal[ray]'``); it is imported only here.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

PLACEMENT_TIMEOUT_S = 120


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise RuntimeError(
            "more than one policy worker (--actor_num_nodes x --actor_num_gpus_per_node > 1) runs on Ray: "
            "pip install 'tidal[ray]', or launch the processes with torchrun instead"
        ) from err
    return ray


def connect() -> None:
    """Join the Ray cluster this process belongs to (``ray job submit``, ``ray start``), else start one."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)


def bundle_resources(devices: int = 1) -> dict[str, float]:
    """``devices`` devices per worker: GPUs where the cluster has GPUs, else CPUs (CPU worker processes)."""
    ray = import_ray()
    return {"GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU": float(devices)}


class RankWorker:
    """The body of a worker actor (wrapped with ``ray.remote`` in ``RayWorkerGroup``)."""

    def node(self) -> tuple[str, str]:
        """(node id, node IP address) of the node this actor was placed on."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, env: dict[str, str], fn: Callable, *args):
        import torch.distributed as dist

        os.environ.update(env)
        try:
            return fn(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


class RayWorkerGroup:
    """``world_size`` ``RankWorker`` actors in one placement group (see the module docstring)."""

    def __init__(self, world_size: int, strategy: str = "PACK", name: str = "tidal-policy",
                 actor_cls: type = RankWorker, init_args: tuple = (), devices: int = 1):  # fmt: skip
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        connect()
        self.world_size, self.resources = world_size, bundle_resources(devices)
        self.pg = placement_group([dict(self.resources) for _ in range(world_size)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(
                f"Ray could not place {world_size} workers of {self.resources} each within "
                f"{PLACEMENT_TIMEOUT_S}s; cluster resources: {ray.cluster_resources()}"
            ) from err
        gpu = "GPU" in self.resources
        actor = ray.remote(num_cpus=0 if gpu else devices, num_gpus=devices if gpu else 0)(actor_cls)
        self.actors = [
            actor.options(
                name=f"{name}-{rank}-{self.pg.id.hex()[:8]}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=rank
                ),
            ).remote(*init_args)
            for rank in range(world_size)
        ]
        self.nodes = ray.get([a.node.remote() for a in self.actors])

    def rank_env(self) -> list[dict[str, str]]:
        """torchrun's variables per rank; the rendezvous is rank 0's node and a free port there."""
        ray = import_ray()
        addr, port = self.nodes[0][1], ray.get(self.actors[0].free_port.remote())
        envs = []
        for rank, (node, _) in enumerate(self.nodes):
            # Ray limits each GPU actor to its own device (CUDA_VISIBLE_DEVICES), so it is cuda:0 there.
            local = 0 if "GPU" in self.resources else sum(n == node for n, _ in self.nodes[:rank])
            envs.append({"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(local),
                         "MASTER_ADDR": addr, "MASTER_PORT": str(port)})  # fmt: skip
        return envs

    def run(self, fn: Callable, *args, rank_args: list[tuple] | None = None) -> list:
        """``fn(*args, *rank_args[rank])`` on every rank; the results in rank order. The first failure is
        raised at once."""
        ray = import_ray()
        extra = rank_args or [()] * self.world_size
        refs = [a.run.remote(env, fn, *args, *more)
                for a, env, more in zip(self.actors, self.rank_env(), extra, strict=True)]  # fmt: skip
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(
                done
            )  # raises the worker's error; the others may wait in a collective: shutdown() ends them
        return ray.get(refs)

    def shutdown(self) -> None:
        ray = import_ray()
        for a in self.actors:
            ray.kill(a)
        ray.util.remove_placement_group(self.pg)

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
