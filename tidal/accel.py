"""Whether the optional Triton kernels (rollout engine, LM head, sampling) can run in this process, and on
what: the GPU's SM count, and whether its copy engine (TMA) can load a tensor."""

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


def tma_loadable(t: torch.Tensor) -> bool:
    """A TMA descriptor can describe ``t`` (2-D, rows of unit stride, 16-byte aligned start and rows) on
    a GPU with the copy engine (Hopper and later): the Triton GEMMs' ``tma`` launches load their tiles so."""
    return (
        t.is_cuda
        and t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.data_ptr() % 16 == 0
        and _has_copy_engine(t.device)
    )


@functools.cache
def _has_copy_engine(device: torch.device) -> bool:
    """Hopper or later (asked once per device, not at every launch)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    """Triton's host-side tensor descriptor of the 2-D ``t`` for tiles of ``block_rows x block_cols``
    (reads past its bounds give zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [block_rows, block_cols])


# The dtype names of --param_dtype and --grad_accum_dtype (OpenRLHF's spellings), for every layer.
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
