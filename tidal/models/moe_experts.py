"""The trainer's MoE experts: transformers' grouped GEMM path, run in the autocast dtype.

transformers 5 runs the experts of Qwen3-MoE, Mixtral, ... through an ``experts_implementation``
registry; its default, ``grouped_mm``, sorts the token/expert pairs by expert and does one grouped GEMM
per projection. Grouped GEMMs are not autocast-aware, so transformers casts the inputs to the weights'
dtype. tidal trains float32 master weights under bf16 autocast (one process; FSDP2 all-gathers bf16
copies instead), so the experts' GEMMs ran in float32, where torch's ``_grouped_mm`` (a bf16 kernel on
CUDA) falls back to one ``mm`` per expert after copying the group offsets to the host.

``TRAINER_EXPERTS`` is the same forward with the expert weights cast to the autocast dtype first (the
cast is differentiable, so gradients reach the float32 weights, as autocast does for ``nn.Linear``).
Without autocast it calls transformers' ``grouped_mm`` forward unchanged, so float32 runs (the CPU's
default) give bit-identical results. ``load_causal_lm`` (policy, reference) and ``load_value_model``
(critic, reward model: ``AutoModelForSequenceClassification``) switch MoE models to it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

TRAINER_EXPERTS = "tidal_grouped_mm"
# The expert tensors transformers' grouped forward reads from ``self`` (gated, plain and biased layouts).
_EXPERT_TENSORS = frozenset(
    {"gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias"}
)


def experts_compute_dtype(weight: Tensor, device_type: str) -> torch.dtype:
    """The dtype the experts' GEMMs run in: autocast's where it is on for ``device_type``, else the
    weights' own (bf16 weights, e.g. FSDP2's all-gathered copies, already reach the bf16 kernel)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class _CastExperts:
    """An experts module seen through its expert tensors cast to ``dtype``; every other attribute
    (sizes, flags, ``act_fn``, ``_apply_gate``) is the module's own."""

    def __init__(self, experts: nn.Module, dtype: torch.dtype):
        self._experts = experts
        self._dtype = dtype

    def __getattr__(self, name: str):
        value = getattr(self._experts, name)
        if name in _EXPERT_TENSORS and isinstance(value, Tensor):
            return value.to(self._dtype)
        return value


def trainer_experts_forward(
    self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' ``grouped_mm`` experts forward with the expert weights in the compute dtype."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    weight = self.gate_up_proj if getattr(self, "has_gate", True) else self.up_proj
    dtype = experts_compute_dtype(weight, hidden_states.device.type)
    if dtype == weight.dtype:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(_CastExperts(self, dtype), hidden_states, top_k_index, top_k_weights)


def register_trainer_experts() -> None:
    """Add ``TRAINER_EXPERTS`` to transformers' experts registry (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(TRAINER_EXPERTS, trainer_experts_forward)


def use_trainer_experts(model: nn.Module) -> nn.Module:
    """Switch a MoE model that runs transformers' default ``grouped_mm`` experts to ``TRAINER_EXPERTS``.

    Dense models, and MoE models on another implementation (``eager`` where transformers found no
    grouped GEMM, or custom code), are left as they are. The choice is not saved with the config."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        return model
    register_trainer_experts()
    model.set_experts_implementation(TRAINER_EXPERTS)
    return model
