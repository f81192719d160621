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


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # the step counter stays where it is
                state[key] = value.to(device, non_blocking=True)


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
        opt.model.to("cpu")
        _move_optimizer_state(opt.optimizer, "cpu")
        torch.cuda.empty_cache()


def reload_to_device(opt) -> None:
    """Inverse of ``offload_to_cpu``."""
    if opt.precision.device.type == "cpu":
        return
    device = opt.precision.device
    with phase(
        f"--deepspeed_enable_sleep: moving {size_text(state_bytes(opt))} of trainer state to {device}"
    ):
        opt.model.to(device)
        _move_optimizer_state(opt.optimizer, device)
