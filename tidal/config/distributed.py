"""Distributed configuration: the seed's DeepSpeed flags mapped onto PyTorch FSDP2.

``--zero_stage 3`` shards parameters, gradients and optimizer state (FSDP2 resharding after
forward); ``1`` and ``2`` shard gradients and optimizer state but keep parameters gathered between
forward and backward; ``0`` replicates (DDP). ``--adam_offload`` keeps sharded parameters,
gradients and optimizer state in CPU memory (FSDP2 ``CPUOffloadPolicy``). With one process these
have nothing to shard and the model trains on the single device.
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
    adam_offload: bool = arg(False, help="keep sharded params, grads and optimizer state on the CPU")
    overlap_comm: bool = arg(False, help="prefetch the next layer's all-gather during compute (more memory)")
    local_rank: int = arg(-1, help="set by launchers; tidal reads LOCAL_RANK from the environment")
    ring_attn_size: int = arg(1, help="ring-attention group size (only 1 is supported)")
    ds_tensor_parallel_size: int = arg(1, help="tensor-parallel size for training (only 1 is supported)")
    zpg: int = arg(1, help="ZeRO++ hierarchical partition size (only 1 is supported)")
    deepcompile: bool = arg(False, help="DeepSpeed DeepCompile (not supported: fails)")

    def problems(self, flags=None) -> list[str]:
        unsupported = {
            "ring_attn_size": (
                self.ring_attn_size != 1,
                "ring attention (sequence parallelism) is not supported yet",
            ),
            "ds_tensor_parallel_size": (
                self.ds_tensor_parallel_size != 1,
                "tensor parallelism for training is not supported; use --zero_stage 3",
            ),
            "zpg": (self.zpg != 1, "ZeRO++ hierarchical partitioning has no FSDP2 equivalent"),
            "deepcompile": (self.deepcompile, "DeepSpeed DeepCompile has no FSDP2 equivalent here"),
        }
        own = [f"--{flag}={getattr(self, flag)}: {why}" for flag, (bad, why) in unsupported.items() if bad]
        return super().problems(flags) + own
