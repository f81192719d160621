"""FP8 rollouts' MoE experts on the fused Triton kernels (``linear.py``'s ``triton_fp8`` mode): whether a
module's experts can run them on e4m3 weights, and the forwards mixed into those that do.
"""

from __future__ import annotations

import torch
from torch import nn


def kernel_problem(module: nn.Module, granularity: str) -> str | None:
    """Why these experts cannot run the fused Triton MoE kernels on e4m3 weights (None: they can)."""
    import torch.nn.functional as F

    from tidal.accel import triton_usable
    from tidal.rollout.models import moe

    weight = module.gate_up_proj
    if granularity != "channel":
        return "block scales (the kernel applies per-channel scales)"
    # the kernels' gated activations: SiLU, or a family's own experts' (``kernel_forward``: gpt-oss's)
    activation = getattr(module, "act", None) is F.silu or hasattr(module, "kernel_forward")
    if not (weight.is_cuda and triton_usable(weight) and moe.FUSED_MOE and activation):
        return "not the fused Triton MoE path"
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return f"{weight.dtype} engine"
    if torch.cuda.get_device_capability(weight.device) < (8, 9):
        return "the GPU has no FP8 tensor cores (sm89+: the kernels run W8A8)"
    return None


class Fp8ExpertsForward:
    """Mixed into ``moe.Experts`` (``triton_fp8`` mode): the fused MoE kernels read the e4m3 experts, quantize
    their activations per row to e4m3 (W8A8, as the dense FP8 linears do: ``kernel_problem`` checked the GPU
    has FP8 MMA) and apply both scales to their float32 accumulators."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from tidal.rollout.kernels.triton_moe import fused_expert_forward
        from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

        scales = (self.fp8_gate_up_proj_scale[..., 0], self.fp8_down_proj_scale[..., 0])
        return fused_expert_forward(
            x, self.fp8_gate_up_proj, self.fp8_down_proj, weights, ids, scales=scales,
            quantize_activations=quantize_rows_triton,
        )  # fmt: skip


class Fp8FamilyExpertsForward:
    """Mixed into a family's own experts (``fp8_parts`` and ``kernel_forward``: gpt-oss's), ``triton_fp8``
    mode: their fused kernels on the e4m3 experts and per-channel scales, W8A8 (activations quantized per row,
    as ``Fp8ExpertsForward``'s; biases stay in the model dtype)."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from tidal.rollout.quant.triton_fp8 import quantize_rows_triton

        scales = (self.fp8_gate_up_proj_scale[..., 0], self.fp8_down_proj_scale[..., 0])
        return self.kernel_forward(
            x, weights, ids, self.fp8_gate_up_proj, self.fp8_down_proj, scales, quantize_rows_triton
        )
