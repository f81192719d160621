"""``--torch_compile``: compile each transformer block with ``torch.compile`` (regional compilation).

The blocks are identical, so dynamo compiles one and reuses it for all (seconds, not minutes, as
compiling the whole model would be); inductor fuses the memory-bound work between the matmuls —
RMSNorm, RoPE, SwiGLU, residual adds, dtype casts — which eager mode runs as separate kernels.
Shapes are dynamic (every packed micro-batch has a different length), so a new length does not
recompile. Applied after activation checkpointing and before FSDP2 sharding, as torchtitan does.
CUDA only: on the CPU the model stays eager (and the test suite never compiles).
"""

from __future__ import annotations

from torch import nn

from tidal.distributed.fsdp import transformer_blocks
from tidal.logging import get_logger

log = get_logger(__name__)


def compile_blocks(model: nn.Module) -> int:
    """Compile every transformer block of ``model`` in place (CUDA); returns how many were compiled."""
    if next(model.parameters()).device.type != "cuda":
        log.warning("--torch_compile: the model is not on CUDA; it stays eager")
        return 0
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)
