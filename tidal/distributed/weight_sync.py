"""Policy weights in the form a rollout engine loads: Hugging Face names, LoRA merged.

``engine_weights(policy)`` yields ``(name, tensor)`` pairs. A peft LoRA policy has its adapters
merged into the base weights for the duration (afterwards the saved base values are put back exactly),
and the peft prefixes (``base_model.model.``, ``.base_layer``) are stripped; adapter tensors are skipped. Sharded
(FSDP2) parameters stay DTensors: the engine gathers each with ``full_tensor()`` as it loads,
so only one full tensor exists at a time.

Engines on devices of their own (``--vllm_num_engines`` without ``--colocate_all_models``) receive
the weights over a process group of their own: the training ranks gather each tensor, and each
trainer casts it to the engine's dtype and broadcasts it in flat buckets of ``bucket_bytes``
(``plan_buckets`` / ``send_weights``) to the engines it drives (``receive_weights``).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from tidal.logging.phases import phase, size_text

_PEFT_PREFIX = re.compile(r"^base_model\.model\.")


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "peft_config")


def hf_name(name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` → ``model.layers.0.q_proj.weight``."""
    return _PEFT_PREFIX.sub("", name).replace(".base_layer.", ".")


@contextlib.contextmanager
def engine_weights(model: nn.Module) -> Iterator[Iterator]:
    """Context yielding an iterator of HF-named tensors of ``model`` (LoRA merged while open)."""
    peft = _is_peft(model)
    saved = _base_weights(model) if peft else []
    if peft:
        model.merge_adapter()
    try:
        named = (
            (hf_name(n), p)
            for n, p in model.named_parameters()
            if "lora_" not in n and "modules_to_save" not in n
        )
        yield named
    finally:
        if peft:
            model.unmerge_adapter()
            # peft unmerges by subtracting the delta it added: W + d - d can be an ulp off W, and
            # the frozen base would drift a little at every sync. Put the exact saved values back.
            with torch.no_grad():
                for weight, copy in saved:
                    weight.copy_(copy)


def _base_weights(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(tensor, copy)`` of the base weight of each LoRA layer (this rank's shard of a DTensor)."""
    saved = []
    for module in model.modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            weight = module.get_base_layer().weight.data
            weight = weight.to_local() if hasattr(weight, "to_local") else weight
            saved.append((weight, weight.clone()))
    return saved


# ---- separate engines: bucketed broadcast over a weight-sync process group --------------------------


@dataclass(frozen=True)
class WeightBucket:
    """Tensors sent as one flat buffer: their names and shapes, in order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class SyncPlan:
    """What a weight sync sends: buckets in order, all in one wire dtype (the engine's)."""

    buckets: tuple[WeightBucket, ...]
    dtype: torch.dtype


def plan_buckets(
    meta: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int
) -> SyncPlan:
    """Group ``(name, shape)`` in order into buckets of at most ``bucket_bytes`` (a larger tensor alone)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    buckets, names, shapes, size = [], [], [], 0
    for name, shape in meta:
        nbytes = math.prod(shape) * itemsize
        if names and size + nbytes > bucket_bytes:
            buckets.append(WeightBucket(tuple(names), tuple(shapes)))
            names, shapes, size = [], [], 0
        names.append(name)
        shapes.append(tuple(shape))
        size += nbytes
    if names:
        buckets.append(WeightBucket(tuple(names), tuple(shapes)))
    return SyncPlan(tuple(buckets), dtype)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded DTensor is all-gathered (a collective over the training ranks)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


def _broadcast(group, buffer: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([buffer], opts).wait()


def send_weights(
    group, named: Sequence[tuple[str, torch.Tensor]], plan: SyncPlan, device: torch.device
) -> None:
    """Sender (rank 0 of ``group``): gather, cast to the wire dtype, flatten and broadcast each bucket.

    Every training rank calls this with the same ``named`` (the gathers are collective); ``group``
    is None on ranks that own no engines, which gather and send nothing."""
    tensors = dict(named)
    itemsize = torch.empty((), dtype=plan.dtype).element_size()
    total = size_text(sum(b.numel for b in plan.buckets) * itemsize)
    what = f"weight sync: {sum(len(b.names) for b in plan.buckets)} tensors, {total} in {len(plan.buckets)} buckets"
    with phase(what, quiet=None if group is not None else True):
        _send_buckets(group, tensors, plan, device)


def _send_buckets(group, tensors: dict, plan: SyncPlan, device: torch.device) -> None:
    for bucket in plan.buckets:
        parts = [_full(tensors[n]).reshape(-1).to(device=device, dtype=plan.dtype) for n in bucket.names]
        if group is not None:
            _broadcast(group, torch.cat(parts) if len(parts) > 1 else parts[0].contiguous())


def receive_weights(group, plan: SyncPlan, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receiver (an engine): each bucket of ``plan`` as ``(name, tensor)`` views of one received buffer."""
    for bucket in plan.buckets:
        buffer = torch.empty(bucket.numel, dtype=plan.dtype, device=device)
        _broadcast(group, buffer)
        views = buffer.split([math.prod(s) for s in bucket.shapes])
        yield [(n, v.view(s)) for n, v, s in zip(bucket.names, views, bucket.shapes, strict=True)]


def open_sync_group(store: dist.Store, rank: int, size: int, backend: str, timeout_s: float = 600.0):
    """A process group of its own (outside the training world) for one trainer and its engines.

    Built directly on ``store`` so that engine processes need no default process group and the
    training ranks' group is untouched; NCCL on CUDA, gloo on the CPU."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
