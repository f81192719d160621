"""LoRA in exact mode (``--exact_logprobs --lora_rank``): the policy computes what the engine runs.

The engine receives merged weights ``W + scale·B·A`` (``tidal.distributed.weight_sync.engine_weights``
merges the adapters for the duration of a sync). For the policy's forward to give the engine's log-probs
bit for bit, a LoRA layer must multiply by that same merged tensor, so in exact mode:

- its no-grad forward (the one whose values the trainer keeps: ``batch_invariant.exact_forward``) builds
  ``W + scale·(B·A)`` and runs ``batch_invariant.linear`` over it, instead of peft's
  ``base(x) + B(A(x))·scale``; with grad enabled (the gradient's forward) it is peft's own;
- the sync's merge is this module's ``merge_weights``, the same arithmetic: ``B·A`` row by row through
  ``batch_invariant.linear`` (a row of the product depends on that row of B alone, so an FSDP2 shard's
  rows equal the unsharded forward's), then one elementwise add;
- both compute in the exact forward's compute dtype (``make_exact``'s: float32 on the CPU, bf16 on
  CUDA), from W, A and B rounded to it: FSDP2 with mixed precision all-gathers them so rounded for the
  forward, and one process's float32 masters are rounded the same way, so every placement merges alike;
- the unmerge only marks the adapters unmerged: ``weight_sync.engine_weights`` saves every LoRA policy's
  base weights before the merge and puts them back after it (peft's ``W + d - d`` can be an ulp off
  ``W``, and the next forward would then differ from what the engine holds).
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.rollout import batch_invariant as bi


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """The peft LoRA linear layers of ``model`` (none for a model without adapters)."""
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def lora_layer_problem(layer: nn.Module) -> str | None:
    """Why ``layer``'s adapters have no exact merged form (None: they have one)."""
    for adapter in layer.lora_A:
        if not isinstance(layer.lora_dropout[adapter], nn.Identity):
            return "LoRA dropout (--lora_dropout > 0) has no merged form"
        if adapter in getattr(layer, "lora_variant", {}) or layer.lora_bias.get(adapter, False):
            return "only plain LoRA adapters (no DoRA or adapter biases) have an exact merged form"
    if getattr(layer, "fan_in_fan_out", False) or not isinstance(layer.get_base_layer(), nn.Linear):
        return f"LoRA on {type(layer.get_base_layer()).__name__} layers (--target_modules) is not covered"
    return None


def lora_delta(b: torch.Tensor, a: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale·(B·A)`` in ``dtype`` (B ``[out, r]``, or some of its rows; A ``[r, in]``), each row of the
    product in a batch-invariant GEMM."""
    return bi.linear(b.to(dtype), a.to(dtype).t()) * scale


def merged_weight(layer: nn.Module) -> torch.Tensor:
    """The base weight plus every active adapter's delta, added in adapter order, in the layer's compute
    dtype (as ``merge_weights``)."""
    dtype = layer.tidal_compute_dtype
    weight = layer.get_base_layer().weight.to(dtype)
    if layer.disable_adapters or layer.merged:  # the base weight alone, or already holding the deltas
        return weight
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            weight = weight + lora_delta(b, a, layer.scaling[adapter], dtype)
    return weight


def exact_lora_forward(layer: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward through its merged weight (``merged_weight``) and ``batch_invariant.linear``."""
    return bi.linear(x, merged_weight(layer), layer.get_base_layer().bias)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather of a DTensor: every rank merges together)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def merge_weights(layers: list[nn.Module]) -> None:
    """Add each active adapter's delta to its base weight in place (this rank's rows of a sharded one)."""
    for layer in layers:
        if layer.disable_adapters or layer.merged:
            continue
        weight = _local(layer.get_base_layer().weight.data)
        merged = weight.to(layer.tidal_compute_dtype)
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            b = _local(layer.lora_B[adapter].weight.data)
            if b.shape[0] != weight.shape[0]:  # FSDP2 shards W and B on their shared output dimension
                raise RuntimeError(f"exact LoRA merge: B rows {b.shape[0]} vs W rows {weight.shape[0]}")
            a = _full(layer.lora_A[adapter].weight.data)
            merged = merged + lora_delta(b, a, layer.scaling[adapter], layer.tidal_compute_dtype)
            layer.merged_adapters.append(adapter)
        weight.copy_(merged)  # a compute-dtype value: exact in the (float32) parameter, and on the wire


def make_lora_exact(model: nn.Module) -> nn.Module:
    """Switch the LoRA layers of a peft ``model`` (already through ``batch_invariant.make_exact``) to their
    merged exact forward, and its ``merge_adapter``/``unmerge_adapter`` (the weight sync's) to the exact
    merge (``engine_weights`` restores the base weights). A model without adapters is returned unchanged."""
    layers = lora_layers(model)
    if not layers:
        return model
    dtype = getattr(model, "tidal_compute_dtype", None) or torch.float32
    for layer in layers:
        problem = lora_layer_problem(layer)
        if problem:  # one line from the CLI, before the first step
            raise ConfigError(f"--exact_logprobs: {problem}")
        layer.tidal_compute_dtype = dtype
        layer.forward = bi.exact_forward(exact_lora_forward, layer)  # no grad: exact

    def merge_adapter(*args, **kwargs) -> None:
        merge_weights(layers)

    def unmerge_adapter(*args, **kwargs) -> None:  # the values: engine_weights puts the saved bases back
        for layer in layers:
            layer.merged_adapters.clear()

    model.merge_adapter, model.unmerge_adapter = merge_adapter, unmerge_adapter
    return model
