"""Batch-invariant mixture-of-experts ops, run by both sides: a router that sums by halving and picks by a
stable sort (``moe_route``), experts as row-invariant GEMMs whose k weighted outputs are added in slot
order (``moe_experts``), and Qwen2-MoE's gated shared expert (``gate_column``, ``shared_expert_mix``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.rollout.batch_invariant.elementwise import pointwise
from tidal.rollout.batch_invariant.matmul import ROW_BLOCK, linear


def moe_route(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k router over ``x [T, H]``: ``(logits, weights [T, k], expert ids [T, k])``. Softmax in float32,
    the k most probable experts (ties to the lower id: a stable sort, not ``topk``, whose CUDA algorithm
    depends on the shape), optional renormalisation over the k; sums by ``tree_sum`` (the same order on
    every device and batch). The weights are rounded to ``weights_dtype`` (None: the logits' dtype, as Qwen
    routers do; Mixtral's stay float32)."""
    logits = linear(x.reshape(-1, x.shape[-1]), weight)
    z = logits.float()
    p = pointwise(torch.exp, z - z.amax(-1, keepdim=True))
    probs, order = torch.sort(p / tree_sum(p), dim=-1, descending=True, stable=True)
    weights, ids = probs[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / tree_sum(weights)
    return logits, weights.to(weights_dtype or logits.dtype), ids


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension (kept, size 1) by halving: zero-padded to a power of two, then the two
    halves added until one column is left. Only elementwise adds, in an order fixed by the length alone
    (torch's CUDA reductions pick their order from the whole tensor's shape)."""
    width = 1 << (x.shape[-1] - 1).bit_length()
    if width != x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for ``x [T, H]`` (stacked experts: ``gate_up_proj``
    [E, 2I, H], gate rows first; ``down_proj`` [E, H, I]). Each expert multiplies its (token, slot) pairs
    in row-invariant GEMMs; the k weighted outputs are then added in slot order (slot 0 + slot 1 + ...),
    so a token's sum never depends on which other tokens share its experts."""
    t, k = ids.shape
    flat, flat_weights = ids.reshape(-1), weights.reshape(-1)
    pairs, outputs = [], []
    for expert in torch.unique(flat).tolist():
        rows = torch.nonzero(flat == expert).view(-1)
        gate, up = linear(x[rows // k], gate_up_proj[expert]).chunk(2, dim=-1)
        out = linear(pointwise(act, gate) * up, down_proj[expert])
        pairs.append(rows)
        outputs.append(out * flat_weights[rows, None])
    values = torch.cat(outputs)
    slots = values.new_zeros(t * k, x.shape[-1]).index_put((torch.cat(pairs),), values).view(t, k, -1)
    total = slots[:, 0]
    for slot in range(1, k):
        total = total + slots[:, slot]
    return total.to(x.dtype)


def shared_expert_mix(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's output: the routed experts' plus ``sigmoid(gate) * shared expert`` (row-invariant)."""
    return routed + pointwise(torch.sigmoid, gate_logit) * shared


def gate_column(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear`` with a one-output weight ``[1, H]`` (Qwen2-MoE's shared-expert gate): run as a
    ``ROW_BLOCK``-column product (zero rows added), since torch's CPU GEMM takes a row-dependent path
    (measured) when the product has a single output column."""
    padded = torch.cat([weight, weight.new_zeros(ROW_BLOCK - 1, weight.shape[-1])])
    return linear(x, padded)[..., :1]
