"""Move a trained role's weights, gradients and optimizer state off the accelerator and back.

``--deepspeed_enable_sleep`` (the hybrid engine): while the rollout engine generates, the trainer's
memory goes to host RAM, and comes back before training. On the CPU there is nothing to move.
"""

from __future__ import annotations

import torch


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # the step counter stays where it is
                state[key] = value.to(device, non_blocking=True)


def offload_to_cpu(opt) -> None:
    """Move ``opt.model`` and ``opt.optimizer`` state to host memory (no-op on CPU devices)."""
    if opt.precision.device.type == "cpu":
        return
    opt.model.to("cpu")
    _move_optimizer_state(opt.optimizer, "cpu")
    torch.cuda.empty_cache()


def reload_to_device(opt) -> None:
    """Inverse of ``offload_to_cpu``."""
    if opt.precision.device.type == "cpu":
        return
    opt.model.to(opt.precision.device)
    _move_optimizer_state(opt.optimizer, opt.precision.device)
