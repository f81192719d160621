"""Exact log-probs in the engine (``EngineConfig.exact_logprobs``): ``make_exact`` switches the decoder's
modules to the batch-invariant ops (``tidal.rollout.batch_invariant``) the trainer's exact forward runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.rollout import batch_invariant as bi
from tidal.rollout.models.layers import ACTIVATIONS as ACTIVATIONS_BY_NAME
from tidal.rollout.models.layers import CausalLM, GatedMLP, RMSNorm, Rotary, fused_kernels_usable
from tidal.rollout.models.moe import SparseMoE
from tidal.rollout.models.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear


def make_exact(model: CausalLM) -> None:
    """Switch the engine's decoder to the batch-invariant ops (``tidal.rollout.batch_invariant``), in place,
    computing what ``batch_invariant.make_exact`` makes a transformers model compute: a packed projection
    runs each of its parts (q, k, v; gate, up) as its own matmul, as the HF model's separate layers do."""
    problem = bi.exact_problem(model.args)
    if problem:
        raise ValueError(problem)
    act = ACTIVATIONS_BY_NAME[model.args.hidden_act]
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.forward = bi.bound_forward(_exact_packed_linear, module)
        elif isinstance(module, (RowParallelLinear, ParallelLMHead)):
            module.forward = bi.bound_forward(lambda m, x: bi.linear(x, m.weight, m.bias), module)
        elif isinstance(module, RMSNorm):
            module.forward = bi.bound_forward(_exact_norm, module)
        elif isinstance(module, Rotary):
            module.forward = bi.bound_forward(_exact_rope, module)
        elif isinstance(module, GatedMLP):
            module.forward = bi.bound_forward(lambda m, x: _exact_gated_mlp(m, x, act), module)
        elif isinstance(module, SparseMoE):
            module.forward = bi.bound_forward(_exact_moe, module)
    _verify_decode_launches(model)


def _verify_decode_launches(model: CausalLM) -> None:
    """On CUDA, let each linear layer's decode steps take its weight's decode launch, q/k/v and gate/up
    packed into one, where ``triton_exact.verify_decode_launch`` sees it give the trainer's launches' bits
    on this GPU (a layer whose launch does not keep them runs the trainer's launches)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            weight = module.weight
            if bi.dispatch.on_triton(weight) and weight.dtype in (
                torch.bfloat16,
                torch.float16,
                torch.float32,
            ):
                parts = [p.size for p in module.parts] if isinstance(module, ColumnParallelLinear) else None
                bi.dispatch.kernels().verify_decode_launch(*weight.shape, weight.dtype, weight.device, parts)


def _exact_gated_mlp(module: GatedMLP, x: torch.Tensor, act) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))``, gate and up as the trainer's separate layers compute them (one
    packed launch at decode where verified, ``bi.linear_parts``). SiLU and the product run as the default
    path's one kernel where it runs (``triton_fused.silu_and_mul``: torch's bits, each rounding included)."""
    gate_up = _exact_packed_linear(module.gate_up_proj, x)
    if act is F.silu and fused_kernels_usable(gate_up):
        from tidal.rollout.models.triton_fused import silu_and_mul

        return module.down_proj(silu_and_mul(gate_up))
    gate, up = gate_up.split([p.size for p in module.gate_up_proj.parts], dim=-1)
    return module.down_proj(bi.pointwise(act, gate) * up)


def _exact_rope(module: Rotary, positions: torch.Tensor, dtype: torch.dtype):
    """``rope_cos_sin`` from the RoPE frequencies (kept on the CPU by ``Rotary.build``) copied once to the
    positions' device: a decode step captured in a CUDA graph cannot copy from the host. On the CPU, rows of
    a table of every position's ``rope_cos_sin`` (built once; a position's row does not depend on the other
    positions computed with it), which saves a step its transcendental calls."""
    if positions.device.type == "cpu":
        cos, sin = _exact_rope_table(module, dtype)
        flat = positions.reshape(-1)
        return tuple(t.index_select(0, flat).view(*positions.shape, t.shape[-1]) for t in (cos, sin))
    cached = getattr(module, "_exact_inv_freq", None)
    if cached is None or cached[0] is not module.inv_freq or cached[1].device != positions.device:
        cached = module._exact_inv_freq = (module.inv_freq, module.inv_freq.to(positions.device))
    return bi.rope_cos_sin(positions, cached[1], module.scale, dtype)


def _exact_rope_table(module: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin`` of positions ``0 .. len(module.cos) - 1`` (the default table's length), cached on the
    module until its frequencies or scale change (a rebuild) or another dtype is asked for."""
    key = (module.inv_freq, module.scale, dtype)
    cached = getattr(module, "_exact_table", None)
    if cached is None or cached[0][0] is not key[0] or cached[0][1:] != key[1:]:
        positions = torch.arange(module.cos.shape[0])
        cached = module._exact_table = (key, bi.rope_cos_sin(positions, module.inv_freq, module.scale, dtype))
    return cached[1]


def _exact_packed_linear(module: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """Each packed part (q, k, v) in a matmul of its own, as the trainer's separate layers."""
    return bi.linear_parts(x, module.weight, module.bias, [p.size for p in module.parts])


def _exact_norm(module: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    """``bi.rms_norm`` of ``x`` (+ ``residual``: then also the sum). On the Triton kernels the residual add
    joins the norm's launch: it rounds the sum as torch's add does, and the engine needs no gradient."""
    if residual is None:
        return bi.rms_norm(x, module.weight, module.eps, module.scale_in_float32)
    if bi.dispatch.on_triton(x) and residual.dtype == x.dtype and not torch.is_grad_enabled():
        weight = module.weight.to(x.dtype)
        return bi.dispatch.kernels().rms_norm(x, weight, module.eps, module.scale_in_float32, residual)
    total = x + residual
    return bi.rms_norm(total, module.weight, module.eps, module.scale_in_float32), total


def _exact_moe(module: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """``SparseMoE.forward`` through the ops the trainer's MoE blocks run in exact mode (``bi.moe_route``)."""
    moe, experts = module.moe, module.experts
    weights_dtype = None if moe.weights_in_model_dtype else torch.float32
    _, weights, ids = bi.moe_route(x, module.gate.weight, moe.top_k, moe.renormalize, weights_dtype)
    if module.recorded is not None:
        module.recorded.append(ids)
    out = bi.moe_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, experts.act)
    if moe.shared_expert_intermediate_size:
        gate_logit = bi.gate_column(x, module.shared_expert_gate.weight)
        out = bi.shared_expert_mix(out, gate_logit, module.shared_expert(x))
    return out
