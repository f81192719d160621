"""Workers on devices of their own: rollout engines, and a frozen reference or reward model.

A worker is an object built from a picklable spec (``factory(spec)``) whose methods the trainer
calls. Two handles drive one with the same ``submit`` / ``result`` / ``call``:

- ``ProcessWorker``: a child process (``spawn``) the trainer starts itself, driven over a pipe —
  local mode and torchrun;
- ``RayWorker``: a Ray actor (``WorkerActor``) the driver placed in a bundle of its own (Ray mode).

Devices of child processes (``ExtraDevices``): on CUDA, the trainers of a node take its first GPUs
(``LOCAL_WORLD_SIZE``); after them every trainer gets a contiguous run of GPUs for its own workers,
engines first, then the reference, then reward models; a critic on devices of its own comes after all
of those (``ExtraDevices.after``). Without GPUs every worker is a CPU process.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from tidal.config import ConfigError
from tidal.data.batching import contiguous_splits
from tidal.distributed.ray_group import RankWorker

ROLES = ("engine", "reference", "reward model")  # the order of a trainer's extra devices


def _serve(conn, factory: Callable, spec) -> None:
    """A child process's loop: build the worker, then run ``(method, args)`` requests until ``None``."""
    try:
        worker = factory(spec)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while (request := conn.recv()) is not None:
        method, args = request
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ProcessWorker:
    """``factory(spec)`` in a child process of this trainer (see the module docstring)."""

    sync_host = "127.0.0.1"  # where the worker reaches this trainer (weight-sync rendezvous)

    def __init__(self, factory: Callable, spec, role: str, device: str):
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn also keeps the child's state clean
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, factory, spec), daemon=True, name=f"tidal-{role}"
        )
        self.process.start()
        child.close()
        self.name = f"{role} process {self.process.pid} ({device})"

    def submit(self, method: str, *args) -> None:
        self.conn.send((method, args))

    def result(self):
        try:
            status, value = self.conn.recv()
        except EOFError as err:
            raise RuntimeError(f"{self.name} exited (code {self.process.exitcode})") from err
        if status == "error":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def call(self, method: str, *args):
        self.submit(method, *args)
        return self.result()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(None)
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
        self.conn.close()


class RayWorker:
    """A ``WorkerActor`` placed by the Ray driver; the driver owns (and kills) the actor."""

    def __init__(self, actor, role: str):
        import ray

        self.actor, self.ref, self.name = actor, None, f"{role} actor {actor}"
        self.sync_host = ray.util.get_node_ip_address()  # this trainer's node: the worker connects to it

    def submit(self, method: str, *args) -> None:
        self.ref = self.actor.call.remote(method, *args)

    def result(self):
        import ray

        return ray.get(self.ref)

    def call(self, method: str, *args):
        self.submit(method, *args)
        return self.result()

    def close(self) -> None:
        self.ref = None


class WorkerActor(RankWorker):
    """The body of a worker's Ray actor: builds ``factory(spec)`` and runs calls on it."""

    def __init__(self, factory: Callable, spec):
        self.worker = factory(spec)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def close(self) -> None:
        """Before the driver kills this actor: the worker's own ``close`` if it has one (a tensor-parallel
        engine stops its rank processes on a command, not on a broken connection once the actor is gone)."""
        if (close := getattr(self.worker, "close", None)) is not None:
            close()


@dataclass(frozen=True)
class ExtraDevices:
    """This trainer's devices for its separate workers: ``counts[role]`` each, in ``ROLES`` order."""

    counts: dict[str, int]

    def devices(self, role: str) -> list[str]:
        count = self.counts.get(role, 0)
        if not torch.cuda.is_available():
            return ["cpu"] * count
        local_rank, local_world = _local_place()
        per_trainer = sum(self.counts.values())
        self._check_gpus(local_world * (1 + per_trainer), self.counts)
        before = sum(self.counts.get(r, 0) for r in ROLES[: ROLES.index(role)])
        first = local_world + local_rank * per_trainer + before
        return [f"cuda:{first + j}" for j in range(count)]

    def after(self, role: str, count: int) -> list[str]:
        """``count`` devices of this trainer for ``role`` (the critic) after every trainer's ``counts``
        workers, which keep their places."""
        if not torch.cuda.is_available():
            return ["cpu"] * count
        local_rank, local_world = _local_place()
        per_trainer = sum(self.counts.values())
        self._check_gpus(local_world * (1 + per_trainer + count), {**self.counts, role: count})
        first = local_world * (1 + per_trainer) + local_rank * count
        return [f"cuda:{first + j}" for j in range(count)]

    @staticmethod
    def _check_gpus(needed: int, counts: dict[str, int]) -> None:
        found, local_world = torch.cuda.device_count(), _local_place()[1]
        if found < needed:
            wanted = ", ".join(f"{n} {r}" for r, n in counts.items() if n)
            raise ConfigError(
                f"separate workers get GPUs of their own: {local_world} trainer(s) with {wanted} each need "
                f"{needed} GPUs on this node, found {found} (colocate them with --colocate_all_models, "
                "--colocate_actor_ref or --colocate_critic_reward, or leave their sizes unset)"
            )


def _local_place() -> tuple[int, int]:
    """(this trainer's local rank, trainers on this node), from torchrun's environment."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def scatter(workers: list, count: int, method: str, args_of: Callable[[int, int], tuple]) -> list:
    """Call ``method`` on every worker with ``args_of(start, stop)`` for its contiguous share of ``count``
    items (all workers at once; empty shares skipped); their results in item order."""
    busy = []
    for worker, (start, stop) in zip(workers, contiguous_splits(count, len(workers)), strict=True):
        if start < stop:
            worker.submit(method, *args_of(start, stop))
            busy.append(worker)
    return [w.result() for w in busy]


def start_process_workers(
    factory: Callable, specs: list, role: str, devices: list[str]
) -> list[ProcessWorker]:
    """Start one child process per ``(spec, device)``; wait until every worker is built."""
    workers = []
    try:
        for spec, device in zip(specs, devices, strict=True):
            workers.append(ProcessWorker(factory, spec, role, device))
        for w in workers:
            w.result()  # ("ok", None) once the worker is built, or its error
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers
