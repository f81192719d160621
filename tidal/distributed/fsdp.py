"""Apply PyTorch FSDP2 (``fully_shard``) to a single-device model, following ``DistributedConfig``.

The model code knows nothing about sharding: this module wraps each transformer block and then the
root. ``--zero_stage`` picks the mesh and resharding (see ``tidal.config.distributed``); stage 0 is
HSDP with shard size 1, i.e. plain replication with gradient all-reduce. With
``--ds_tensor_parallel_size`` the decoder layers are first split over tensor-parallel ranks and FSDP2
shards over the data-parallel sub-mesh (``tidal.distributed.tensor_parallel``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from tidal.accel import DTYPE_NAMES
from tidal.config.distributed import DistributedConfig
from tidal.distributed.offload import cpu_offload_policy, ensure_process_group
from tidal.distributed.tensor_parallel import apply_tensor_parallel, training_mesh
from tidal.distributed.world import World
from tidal.logging import get_logger
from tidal.logging.phases import phase

log = get_logger(__name__)


def grad_accum_dtype(name: str | None) -> torch.dtype:
    """Map ``--grad_accum_dtype`` (``fp32``/``bf16``/``fp16``, unset: fp32) to a torch dtype."""
    return torch.float32 if name is None else DTYPE_NAMES[name]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks, found by the HF ``_no_split_modules`` class names."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    for sub in model.modules():  # peft wraps the HF model; its inner model carries the names
        names |= set(getattr(sub, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"cannot find transformer blocks to shard in {type(model).__name__}")
    return blocks


def parallelize(
    model: nn.Module, cfg: DistributedConfig, world: World, compute_dtype: torch.dtype
) -> nn.Module:
    """Shard ``model`` over ``world`` in place and return it; with a single process a no-op, unless
    ``--adam_offload`` asks for its weights, gradients and optimizer state in host memory."""
    if cfg.adam_offload and world.device.type == "cpu":
        log.info(
            "--adam_offload: training on the CPU, the weights and optimizer state are in CPU memory already"
        )
    mp = mixed_precision(cfg, compute_dtype)
    if not world.distributed:
        if cfg.adam_offload and world.device.type == "cuda":
            return offload_single_device(model, world.device, compute_dtype, cfg.zero_stage == 3, mp)
        if mp.reduce_dtype != torch.float32:  # --grad_accum_dtype bf16/fp16 asks FSDP2 to round grads
            return shard_single_device(model, world.device, mp, cfg.zero_stage == 3)
        return model
    mesh, tp_mesh = training_mesh(world, cfg.zero_stage)
    if tp_mesh is not None:  # split the decoder layers over tp first; FSDP2 shards the rest over dp
        apply_tensor_parallel(model, tp_mesh)
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.zero_stage == 3)
    if cfg.adam_offload and world.device.type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    blocks = transformer_blocks(model)
    with phase(f"FSDP2: sharding {len(blocks)} blocks over {world.world_size} ranks"):
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    if cfg.overlap_comm:
        for prev, nxt in zip(blocks, blocks[1:], strict=False):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


def mixed_precision(cfg: DistributedConfig, compute_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2's policy: weights stay float32 (master copy); compute and all-gathers use
    ``compute_dtype``; gradients are reduced, and accumulated between micro-batches without a sync, in
    ``--grad_accum_dtype`` (float32 unless set)."""
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=grad_accum_dtype(cfg.grad_accum_dtype)
    )


def offload_single_device(
    model: nn.Module,
    device: torch.device,
    compute_dtype: torch.dtype,
    reshard_after_forward: bool,
    mp: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """``--adam_offload`` with one process: FSDP2 with ``CPUOffloadPolicy`` on a one-device mesh, so
    weights (float32), gradients and AdamW state live in host memory and AdamW steps there; each block's
    weights are copied to ``device`` in ``compute_dtype`` for its forward and backward."""
    mp = mp or MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    return shard_single_device(model, device, mp, reshard_after_forward, cpu_offload_policy(device))


def shard_single_device(
    model: nn.Module,
    device: torch.device,
    mp: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    offload_policy: CPUOffloadPolicy | None = None,
) -> nn.Module:
    """FSDP2 on a one-device mesh (one process): what ``--adam_offload`` (with ``offload_policy``) and
    ``--grad_accum_dtype bf16/fp16`` (the policy's ``reduce_dtype``) need from FSDP2 with nothing to shard."""
    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (1,))
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    blocks = transformer_blocks(model)
    where = "host memory" if offload_policy is not None else str(device)
    with phase(
        f"FSDP2: wrapping {len(blocks)} blocks on one device (weights and optimizer state in {where})"
    ):
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduce-scatter on all but the last micro-batch of an accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
