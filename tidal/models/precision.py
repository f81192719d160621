"""Numeric precision: master weights and optimizer state in ``--master_dtype``, lower-precision compute.

``--param_dtype bf16|fp16`` runs forward and backward under ``torch.autocast`` while parameters,
gradients and AdamW state stay in ``--master_dtype`` (float32 unless bf16 is asked for; the dtype
``tidal.models.loading`` stores the weights in) and FSDP2 all-gathers in the compute dtype.
fp16 needs loss scaling, which ``Precision.scaler`` provides. ``auto`` is bf16 on CUDA and fp32 on
the CPU, where bf16 matmuls are about 20x slower.

Gradients therefore are float32 whatever ``--param_dtype`` says (bf16 with ``--master_dtype bf16``).
``--grad_accum_dtype`` (OpenRLHF's DeepSpeed option) picks the dtype FSDP2 reduces them in across
processes and accumulates them in between the micro-batches of one step (``grad_accum_dtype``); unset,
that is float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from tidal.accel import DTYPE_NAMES


def resolve_dtype(param_dtype: str, device: torch.device) -> torch.dtype:
    """Map the ``--param_dtype`` choice to a torch dtype for ``device``."""
    if param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPE_NAMES[param_dtype]


@dataclass
class Precision:
    """Autocast context and (for fp16) a gradient scaler for one device."""

    dtype: torch.dtype
    device: torch.device
    scaler: torch.amp.GradScaler | None = field(default=None, repr=False)

    @classmethod
    def create(cls, param_dtype: str, device: torch.device) -> Precision:
        dtype = resolve_dtype(param_dtype, device)
        scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        return cls(dtype=dtype, device=device, scaler=scaler)

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)
