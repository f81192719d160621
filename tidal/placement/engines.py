"""Rollout engines on devices of their own, each in a process (or Ray actor) of its own.

``--vllm_num_engines E`` without ``--colocate_all_models`` gives every policy worker ``E / T`` engines
(T: the number of policy workers) on separate devices. An ``EngineWorker`` holds one engine and the
agent executor, and returns trajectories; scoring stays with the trainer. Prompts with images arrive
with their ``ImageRef``s, which the engine process turns into pixels (``run_with_images``). The trainer
drives it through a ``tidal.placement.workers`` handle: a child process it starts itself (local mode and
torchrun; on CUDA the GPUs after the trainers', see ``ExtraDevices``) or a Ray actor the driver
placed (Ray mode).

Weights travel over a process group of their own per trainer (the trainer is rank 0, its engines
follow): see ``tidal.distributed.weight_sync``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tidal.config import ModelConfig
from tidal.config.engine import rollout_engine_config
from tidal.config.rl import AgentConfig
from tidal.distributed.weight_sync import SyncPlan, open_sync_group, receive_weights
from tidal.experience.images import run_with_images
from tidal.models import load_tokenizer
from tidal.placement.protocols import PlacedRun
from tidal.placement.rollout import build_executor
from tidal.placement.workers import ExtraDevices, ProcessWorker, start_process_workers
from tidal.rollout import EngineConfig, SamplingParams, make_engine

STARTUP_TIMEOUT_S = 600


@dataclass
class EngineSpec:
    """Everything an engine process needs to build its engine and agent executor (picklable)."""

    model_path: str
    model: ModelConfig
    engine: EngineConfig
    agent: AgentConfig
    apply_chat_template: bool
    num_threads: int  # CPU: torch threads of the engine process (the trainer's own count)

    def on_device(self, device: str) -> EngineSpec:
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, device=device))


def engine_spec(run: PlacedRun) -> EngineSpec:
    """A run's engines: the policy checkpoint, ``--vllm_*`` settings, agent and chat template."""
    return EngineSpec(run.actor.pretrain, run.actor, rollout_engine_config(run.rollout, "auto", run.train.seed),
                      run.agent, run.data.apply_chat_template, torch.get_num_threads())  # fmt: skip


class EngineWorker:
    """One rollout engine and its agent executor, in the process (or Ray actor) that owns the device."""

    def __init__(self, spec: EngineSpec):
        torch.set_num_threads(spec.num_threads)
        device = spec.engine.torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        self.engine = make_engine(spec.model_path, spec.engine)
        self.engine.progress_label = "generation"  # requests done and tokens/s, logged as they go
        self.tokenizer = load_tokenizer(spec.model_path, spec.model)
        self.executor = build_executor(spec.agent, spec.apply_chat_template)
        self.group = None

    def describe(self) -> tuple[str, str]:
        """(device, dtype) of the engine, e.g. ``("cuda:1", "torch.bfloat16")``."""
        return str(self.engine.device), str(self.engine.dtype)

    def trajectories(
        self, prompts: list, labels: list, params: SamplingParams, total_len: int, first_index: int,
        images: list | None = None,
    ):  # fmt: skip
        """The executor's trajectories of ``prompts``; ``images``: each prompt's ``ImageRef``s, if any has one."""
        if self.engine.is_sleeping:
            self.engine.wake_up()
        offset = {"first_index": first_index} if first_index else {}

        def run(engine):
            return self.executor.run(engine, self.tokenizer, prompts, labels, params, total_len, **offset)

        return run_with_images(self.engine, images or [], params.n, run)

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

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (a Ray actor is killed without running exit hooks)."""
        self.engine.close()


def start_process_engines(
    spec: EngineSpec, count: int, devices: list[str] | None = None
) -> list[ProcessWorker]:
    """Start ``count`` engine processes on ``devices`` (default: this trainer's engine devices when it
    has ``count`` of them and no other separate workers); wait until their engines are built."""
    devices = devices or ExtraDevices({"engine": count}).devices("engine")
    specs = [spec.on_device(d) for d in devices]
    return start_process_workers(EngineWorker, specs, "engine", devices)
