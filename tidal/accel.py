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


DEFAULT_SMS = 132  # an H200; only used off CUDA (Triton's interpreter), where it just sets how work is cut


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``DEFAULT_SMS`` off CUDA): what the kernels size their
    grids by (split-K, split contexts, vocabulary chunks)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# The dtype names of --param_dtype and --grad_accum_dtype (OpenRLHF's spellings), for every layer.
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
