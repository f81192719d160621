"""Whether the optional Triton kernels (rollout engine, LM head, sampling) can run in this process."""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    """Triton importable (CUDA builds of torch ship it; CPU builds usually do not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_usable(t: torch.Tensor) -> bool:
    """Triton kernels can run on ``t``: a CUDA tensor, with Triton installed."""
    return t.is_cuda and triton_available()


# The dtype names of --param_dtype and --grad_accum_dtype (OpenRLHF's spellings), for every layer.
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
