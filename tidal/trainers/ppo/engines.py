"""Rollout engines on devices of their own, each in a process of its own.

``--vllm_num_engines E`` without ``--colocate_all_models`` gives every policy worker ``E / T`` engines
(T: the number of policy workers) on separate devices. An ``EngineWorker`` holds one engine and the
agent executor, and returns trajectories; scoring stays with the trainer. Two kinds of handle
drive a worker with the same ``submit`` / ``result`` calls:

- ``ProcessEngine``: a child process (``spawn``) the trainer starts itself, driven over a pipe —
  local mode and torchrun. On CUDA the engines of local rank ``l`` take the GPUs after the
  trainers': ``LOCAL_WORLD_SIZE + l * E/T + j``; without GPUs each engine is a CPU process.
- ``RayEngine``: a Ray actor the driver placed in a bundle of its own (Ray mode).

Weights travel over a process group of their own per trainer (the trainer is rank 0, its engines
follow): see ``tidal.distributed.weight_sync``.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.config import ConfigError, ModelConfig
from tidal.config.rl import RLModelsConfig, RolloutConfig
from tidal.distributed.ray_group import RankWorker
from tidal.distributed.weight_sync import SyncPlan, open_sync_group, receive_weights
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

STARTUP_TIMEOUT_S = 600


def engine_config(cfg: RolloutConfig, device: torch.device | str, seed: int) -> EngineConfig:
    """The engine's settings from the seed's ``--vllm_*`` flags (shared by local and separate engines)."""
    return EngineConfig(
        max_num_seqs=cfg.vllm_generate_batch_size or 256,
        max_model_len=cfg.total_len,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        device=str(device),
        seed=seed,
        enforce_eager=cfg.enforce_eager,
    )


@dataclass
class EngineSpec:
    """Everything an engine process needs to build its engine and agent executor (picklable)."""

    model_path: str
    model: ModelConfig
    engine: EngineConfig
    models: RLModelsConfig
    apply_chat_template: bool
    num_threads: int  # CPU: torch threads of the engine process (the trainer's own count)


def engine_spec(run) -> EngineSpec:
    """A ``PPORun``'s engines: the policy checkpoint, ``--vllm_*`` settings, agent and chat template."""
    return EngineSpec(run.model.pretrain, run.model, engine_config(run.rollout, "auto", run.train.seed),
                      run.models, run.data.apply_chat_template, torch.get_num_threads())  # fmt: skip


class EngineWorker:
    """One rollout engine and its agent executor, in the process (or Ray actor) that owns the device."""

    def __init__(self, spec: EngineSpec):
        from tidal.models import load_tokenizer
        from tidal.trainers.ppo.rollout import build_executor

        torch.set_num_threads(spec.num_threads)
        device = spec.engine.torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        self.engine = LLMEngine(spec.model_path, spec.engine)
        self.tokenizer = load_tokenizer(spec.model_path, spec.model)
        self.executor = build_executor(spec.models, spec.apply_chat_template)
        self.group = None

    def describe(self) -> tuple[str, str]:
        """(device, dtype) of the engine, e.g. ``("cuda:1", "torch.bfloat16")``."""
        return str(self.engine.device), str(self.engine.dtype)

    def trajectories(
        self, prompts: list, labels: list, params: SamplingParams, total_len: int, first_index: int
    ):
        if self.engine.is_sleeping:
            self.engine.wake_up()
        offset = {"first_index": first_index} if first_index else {}
        return self.executor.run(self.engine, self.tokenizer, prompts, labels, params, total_len, **offset)

    def open_sync_group(self, host: str, port: int, rank: int, size: int, backend: str) -> None:
        store = dist.TCPStore(host, port, size, False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        self.group = open_sync_group(store, rank, size, backend)

    def receive_weights(self, plan: SyncPlan) -> int:
        count = 0
        for bucket in receive_weights(self.group, plan, self.engine.device):
            count += self.engine.update_weights(bucket)
        return count

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's parameters on the CPU (its own fused names), to check a sync."""
        return {n: p.detach().cpu() for n, p in self.engine.model.named_parameters()}

    def sleep(self) -> None:
        self.engine.sleep()


def _serve(conn, spec: EngineSpec) -> None:
    """A child process's loop: build the worker, then run ``(method, args)`` requests until ``None``."""
    try:
        worker = EngineWorker(spec)
        conn.send(("ok", worker.describe()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while (request := conn.recv()) is not None:
        method, args = request
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ProcessEngine:
    """An ``EngineWorker`` in a child process of this trainer (see the module docstring)."""

    sync_host = "127.0.0.1"

    def __init__(self, spec: EngineSpec):
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn also keeps the child's state clean
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, spec), daemon=True, name="tidal-engine")
        self.process.start()
        child.close()
        self.name = f"engine process {self.process.pid} ({spec.engine.device})"

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


class RayEngine:
    """An ``EngineWorker`` in a Ray actor (``ray_mode`` creates it in a placement-group bundle)."""

    def __init__(self, actor):
        import ray

        self.actor, self.ref, self.name = actor, None, f"engine actor {actor}"
        self.sync_host = ray.util.get_node_ip_address()  # this trainer's node: the engines connect to it

    def submit(self, method: str, *args) -> None:
        self.ref = self.actor.call.remote(method, *args)

    def result(self):
        import ray

        return ray.get(self.ref)

    def call(self, method: str, *args):
        self.submit(method, *args)
        return self.result()

    def close(self) -> None:  # the driver owns the actor and kills it
        self.ref = None


class EngineActor(RankWorker):
    """The body of an engine's Ray actor: builds an ``EngineWorker`` and runs calls on it."""

    def __init__(self, spec: EngineSpec):
        self.worker = EngineWorker(spec)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


def engine_devices(count: int) -> list[str]:
    """Devices for this trainer's ``count`` engine processes (see the module docstring)."""
    if not torch.cuda.is_available():
        return ["cpu"] * count
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    needed, found = local_world * (1 + count), torch.cuda.device_count()
    if found < needed:
        raise ConfigError(
            f"--vllm_num_engines without --colocate_all_models puts every engine on a GPU of its own: "
            f"{local_world} trainer(s) with {count} engine(s) each need {needed} GPUs on this node, found "
            f"{found} (pass --colocate_all_models to share the policy's GPUs)"
        )
    first = local_world + local_rank * count
    return [f"cuda:{first + j}" for j in range(count)]


def start_process_engines(
    spec: EngineSpec, count: int, devices: list[str] | None = None
) -> list[ProcessEngine]:
    """Start ``count`` engine processes on ``devices`` (default: this trainer's engine devices, see the
    module docstring); wait until their engines are built."""
    engines = []
    try:
        for device in devices or engine_devices(count):
            engines.append(ProcessEngine(_on_device(spec, device)))
        for e in engines:
            e.result()  # the worker's ("ok", describe()) once its engine is built, or its error
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


def _on_device(spec: EngineSpec, device: str) -> EngineSpec:
    import dataclasses

    return dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, device=device))
