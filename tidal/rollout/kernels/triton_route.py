"""The fused MoE router in Triton: ``moe.route`` on CUDA (up to 1024 experts).

``fused_route`` computes the routing in one launch: softmax, top-k (lower expert id first among equal
logits), renormalisation and the cast to the model dtype, in place of ~6 torch kernels (``torch.topk``
alone is two). Split from ``triton_moe.py`` (the experts' kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # accurate expf, as torch's CUDA softmax uses (triton >= 3.0 moved it)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older triton
    from triton.language.extra.cuda import libdevice

# ``fused_route``'s programs are one warp each, holding a block of rows times every expert (padded to a
# power of two) in registers: 4 elements per thread (128 experts: one row per program), so every
# reduction stays within the warp (shuffles, no shared memory or barrier); up to 32 per thread (1024
# experts, 127 registers on sm_90 without spills).
ROUTE_KERNEL_MAX_EXPERTS = 1024
ROUTE_ELEMENTS = 128  # rows x padded experts per program
ROUTE_MAX_ROWS = 64


def route_kernel_fits(router_logits: torch.Tensor) -> bool:
    """``_route_kernel`` takes these logits: [tokens, experts] with at most 1024 experts."""
    return router_logits.dim() == 2 and router_logits.shape[1] <= ROUTE_KERNEL_MAX_EXPERTS


def fused_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_model_dtype: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.route`` in one launch of ``_route_kernel``: (weights [T, k], expert ids [T, k] int64).

    The same arithmetic as the torch ops: a float32 softmax ``exp(z - max) / sum`` (libdevice ``expf`` and
    IEEE division, as torch's CUDA softmax), the k largest in descending order, optionally divided by
    their float32 sum, rounded to the logits' dtype when ``weights_in_model_dtype``. Only the order of
    the softmax sum differs (weights within 1e-6 relative, a few float32 ulps). Ties: among equal logits the lower
    expert id comes first (``torch.topk``'s order among equal values on CUDA is unspecified; exact mode's
    stable sort also puts the lower id first). No host sync: CUDA graphs capture it."""
    if not route_kernel_fits(router_logits) or not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(
            f"triton_route.fused_route: logits of shape {tuple(router_logits.shape)} with top_k={top_k}; the "
            f"kernel takes [tokens, experts <= {ROUTE_KERNEL_MAX_EXPERTS}] and 1 <= top_k <= experts"
        )
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    weights_dtype = router_logits.dtype if weights_in_model_dtype else torch.float32
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return weights, ids
    experts = triton.next_power_of_2(num_experts)
    rows = max(1, min(ROUTE_MAX_ROWS, ROUTE_ELEMENTS // experts))
    _route_kernel[(triton.cdiv(num_tokens, rows),)](
        router_logits,
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        router_logits.stride(1),
        TOP_K=top_k,
        SLOTS=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=rows,
        EXPERTS=experts,
        num_warps=1,
    )
    return weights, ids


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    stride_t,
    stride_e,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EXPERTS: tl.constexpr,
):
    """``BLOCK_T`` rows of logits: softmax, then ``TOP_K`` rounds of "the largest logit not taken yet,
    the lowest column among equal ones", one (value, index) reduction each.

    The rounds compare the logits, not the probabilities: softmax is monotone, so the order is the
    same wherever the probabilities differ, and no rounding of exp or of the division can swap or tie
    two nearly equal ones (equal logits tie, lowest id first). A pick's weight is computed from its
    logit by the formula of every element, ``exp(z - max) / sum``: the same float. Taken columns and
    the padding read -inf; a row's own -inf logits read the lowest finite float instead, so they still
    rank above those and are picked each once (their weight is exp(-huge) = 0, as exp(-inf))."""
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < num_tokens
    safe_row = tl.minimum(row, num_tokens - 1).to(tl.int64)  # rows past the end read the last row
    col = tl.arange(0, EXPERTS)[None, :]
    ptrs = logits_ptr + safe_row[:, None] * stride_t + col * stride_e
    z = tl.load(ptrs, mask=col < num_experts, other=float("-inf")).to(tl.float32)
    top = tl.max(z, 1)
    total = tl.sum(libdevice.exp(z - top[:, None]), 1)  # padding columns add exp(-inf) = 0

    slot = tl.arange(0, SLOTS)[None, :]
    key = tl.where(z == float("-inf"), -3.4028234663852886e38, z)
    key = tl.where(col < num_experts, key, float("-inf"))
    picked_w = tl.zeros([BLOCK_T, SLOTS], dtype=tl.float32)
    picked_id = tl.zeros([BLOCK_T, SLOTS], dtype=tl.int32)
    kept = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best, pick = tl.max(key, 1, return_indices=True, return_indices_tie_break_left=True)
        key = tl.where(col == pick[:, None], float("-inf"), key)
        w = tl.math.div_rn(libdevice.exp(best - top), total)
        kept += w  # slot order: ((w0 + w1) + w2) + ...
        picked_w = tl.where(slot == j, w[:, None], picked_w)
        # Only a row of NaNs (no order) can pick the padding: keep the ids in range.
        picked_id = tl.where(slot == j, tl.minimum(pick, num_experts - 1)[:, None], picked_id)
    if RENORMALIZE:
        picked_w = tl.math.div_rn(picked_w, kept[:, None])

    out = row.to(tl.int64)[:, None] * TOP_K + slot
    ok = row_ok[:, None] & (slot < TOP_K)
    tl.store(weights_ptr + out, picked_w.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + out, picked_id.to(tl.int64), mask=ok)
