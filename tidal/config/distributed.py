"""Distributed configuration: the seed's DeepSpeed flags mapped onto PyTorch FSDP2.

``--zero_stage 3`` shards parameters, gradients and optimizer state (FSDP2 resharding after
forward); ``1`` and ``2`` shard gradients and optimizer state but keep parameters gathered between
forward and backward; ``0`` replicates (DDP). ``--adam_offload`` keeps (sharded) parameters,
gradients and optimizer state in CPU memory and steps AdamW there (FSDP2 ``CPUOffloadPolicy``; with
one process on a one-device mesh); training on the CPU it changes nothing (a log line says so). With
one process the ZeRO stages have nothing to shard and the model trains on the single device.
``--grad_accum_dtype`` is FSDP2's ``reduce_dtype`` (``tidal.models.precision``): float32 unless set.

``--ring_attn_size N`` (sequence parallelism, ``tidal.models.ring_attention``) needs packed samples and
a world size that N divides; ``--ring_head_stride`` is the number of key/value heads per ring pass.

``--ds_tensor_parallel_size N`` splits the decoder layers over N consecutive ranks (DTensor tensor
parallelism inside FSDP2, ``tidal.distributed.tensor_parallel``); the layouts it cannot train (N not
dividing the processes, heads or MLP width; LoRA; MoE) are refused there, before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import Checked, arg


@dataclass
class DistributedConfig(Checked):
    """Distributed training (FSDP2); DeepSpeed-style flags keep their names."""

    zero_stage: int = arg(
        2, help="0: replicate (DDP); 1/2: shard grads+optimizer; 3: also shard params", choices=(0, 1, 2, 3)
    )
    adam_offload: bool = arg(
        False,
        help="keep params, grads and AdamW state in CPU memory and step AdamW there (GPU training, any "
        "number of processes; nothing changes when training on the CPU)",
    )
    overlap_comm: bool = arg(False, help="prefetch the next layer's all-gather during compute (more memory)")
    local_rank: int = arg(-1, help="set by launchers; tidal reads LOCAL_RANK from the environment")
    ring_attn_size: int = arg(
        1, help="ring-attention group size: each packed row is split along the sequence over this many ranks"
    )
    ring_head_stride: int = arg(
        1, help="key/value heads passed around the ring at a time (larger: faster, more memory)"
    )
    ds_tensor_parallel_size: int = arg(
        1, help="tensor-parallel size for training (DTensor TP inside FSDP2; must divide the process count)"
    )
    grad_accum_dtype: str | None = arg(
        None,
        help="dtype gradients are reduced across processes and accumulated in over a step's micro-batches "
        "(FSDP2's reduce_dtype; OpenRLHF's DeepSpeed option). Unset = fp32: tidal keeps float32 master "
        "weights (unless --master_dtype bf16), so with any --param_dtype gradients are float32 already; "
        "bf16/fp16 round them to that "
        "dtype (less communication; with one process FSDP2 wraps the model on its one device)",
        choices=("fp32", "bf16", "fp16"),
    )
    zpg: int = arg(1, help="ZeRO++ hierarchical partition size (only 1 is supported)")
    deepcompile: bool = arg(False, help="DeepSpeed DeepCompile (not supported: fails)")

    def problems(self, flags=None) -> list[str]:
        unsupported = {
            "ds_tensor_parallel_size": (self.ds_tensor_parallel_size < 1, "must be at least 1"),
            "zpg": (self.zpg != 1, "ZeRO++ hierarchical partitioning has no FSDP2 equivalent"),
            "deepcompile": (self.deepcompile, "DeepSpeed DeepCompile has no FSDP2 equivalent here"),
        }
        own = [f"--{flag}={getattr(self, flag)}: {why}" for flag, (bad, why) in unsupported.items() if bad]
        return super().problems(flags) + own + self.ring_problems()

    def ring_problems(self) -> list[str]:
        """Ring-attention settings that cannot work whatever the world size."""
        problems = [
            f"--{flag} must be >= 1, got {getattr(self, flag)}"
            for flag in ("ring_attn_size", "ring_head_stride")
            if getattr(self, flag) < 1
        ]
        if self.ring_attn_size > 1 and self.ds_tensor_parallel_size > 1:
            problems.append(
                f"--ring_attn_size {self.ring_attn_size} with --ds_tensor_parallel_size "
                f"{self.ds_tensor_parallel_size}: ring attention and tensor-parallel training do not combine "
                "yet; use one of them"
            )
        return problems


def ring_layout_problems(ring_size: int, world_size: int) -> list[str]:
    """One line per impossible ring layout (none when ring attention is off)."""
    if ring_size > 1 and world_size % ring_size:
        return [
            f"--ring_attn_size {ring_size} must divide the number of processes ({world_size}): "
            "the world splits into ring groups of that many consecutive ranks"
        ]
    return []
