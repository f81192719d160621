"""Keep a trained role's weights, gradients and optimizer state off the accelerator.

- ``--deepspeed_enable_sleep`` (the hybrid engine): while the rollout engine generates, the trainer's
  memory goes to host RAM (``offload_to_cpu``), and comes back before training (``reload_to_device``).
- ``--adam_offload``: FSDP2's ``CPUOffloadPolicy`` (``tidal.distributed.fsdp``) keeps them in host
  memory for the whole run and AdamW steps there. With one process FSDP2 still needs a process group
  for its one-device mesh: ``ensure_process_group`` starts one (gloo for CPU tensors, NCCL for CUDA).

On the CPU there is nothing to move.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from tidal.logging.phases import phase, size_text


def ensure_process_group(device: torch.device) -> None:
    """A one-process default group for ``device`` unless one exists (destroyed at exit)."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(destroy_own_group)


def destroy_own_group() -> None:
    if dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()


def cpu_offload_policy(device: torch.device) -> CPUOffloadPolicy:
    """Host copies pinned where there is a GPU to copy them to (pinning needs CUDA)."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def state_bytes(opt) -> int:
    """Bytes of ``opt``'s weights, gradients and optimizer state: what a sleep moves."""
    tensors = [*opt.model.parameters(), *(p.grad for p in opt.model.parameters() if p.grad is not None)]
    tensors += [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def offload_to_cpu(opt) -> None:
    """Move ``opt.model`` and ``opt.optimizer`` state to host memory (no-op on CPU devices)."""
    if opt.precision.device.type == "cpu":
        return
    with phase(
        f"--deepspeed_enable_sleep: moving {size_text(state_bytes(opt))} of trainer state to host memory"
    ):
        move_state(opt.model, opt.optimizer, HostMirror.of(opt), to_host=True)
        torch.cuda.synchronize()  # the copies land before the device memory is handed back
        torch.cuda.empty_cache()


def reload_to_device(opt) -> None:
    """Inverse of ``offload_to_cpu``."""
    if opt.precision.device.type == "cpu":
        return
    device = opt.precision.device
    with phase(
        f"--deepspeed_enable_sleep: moving {size_text(state_bytes(opt))} of trainer state to {device}"
    ):
        move_state(opt.model, opt.optimizer, HostMirror.of(opt), to_host=False, device=device)


class HostMirror:
    """One host buffer per tensor of the trainer state, allocated at the first sleep and reused at every
    later one. Pinned where there is a GPU: a copy from pageable memory runs at a few GB/s and allocates
    anew each time (a 7B model's 30 GiB took 24 s to leave the H200), a copy into pinned memory at the
    bus's speed, asynchronously, tensor after tensor."""

    def __init__(self, pin: bool, device_only: bool = True) -> None:
        self.pin = pin
        # Tensors already in host memory (--adam_offload's FSDP2 state) stay there, and are not brought to
        # the device at wake-up; tests on the CPU turn this off to exercise the copies.
        self.device_only = device_only
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}
        self.moved: set[tuple[int, str]] = set()  # what the last sleep moved, and the wake brings back

    @classmethod
    def of(cls, opt) -> HostMirror:
        """The mirror kept on ``opt`` (made on first use)."""
        mirror = getattr(opt, "_host_mirror", None)
        if mirror is None:
            mirror = opt._host_mirror = cls(pin=torch.cuda.is_available())
        return mirror

    def to_host(self, key: tuple[int, str], value: torch.Tensor) -> torch.Tensor:
        local = _local(value)
        if self.device_only and local.device.type == "cpu":
            return value
        self.moved.add(key)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
            self.buffers[key] = buffer
        buffer.copy_(local, non_blocking=self.pin)
        return _like(value, buffer)

    def to_device(self, key: tuple[int, str], value: torch.Tensor, device: torch.device) -> torch.Tensor:
        if key not in self.moved:
            return value
        self.moved.discard(key)
        local = _local(value)
        moved = torch.empty(local.shape, dtype=local.dtype, device=device)
        moved.copy_(local, non_blocking=self.pin)
        return _like(value, moved)


def move_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mirror: HostMirror,
    to_host: bool,
    device: torch.device | None = None,
) -> None:
    """Move every parameter, gradient, buffer and optimizer-state tensor of a trained role between the
    device and ``mirror``'s host buffers, in place (the ``nn.Parameter`` objects, and so the optimizer's
    references to them, stay the same). The step counters (0-d) stay where they are."""

    def move(key: tuple[int, str], value: torch.Tensor) -> torch.Tensor:
        return mirror.to_host(key, value) if to_host else mirror.to_device(key, value, device)

    for param in model.parameters():
        param.data = move((id(param), "param"), param.data)
        if param.grad is not None:
            param.grad = move((id(param), "grad"), param.grad)
        for name, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                optimizer.state[param][name] = move((id(param), f"state.{name}"), value)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = move((id(module), f"buffer.{name}"), buffer)


def _local(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2's parameters), else the tensor itself."""
    return value.to_local() if isinstance(value, DTensor) else value


def _like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``value`` was: a DTensor over the same mesh and placements, or a plain tensor."""
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(
        local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )
