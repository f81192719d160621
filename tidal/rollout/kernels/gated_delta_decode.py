"""One decode step of the gated delta rule (Qwen3.5's Gated DeltaNet layers) as one Triton launch per layer,
reading and writing the recurrent states at the step's state slots (and the causal conv before it, as one
more launch).

Why a kernel of tidal's own. At batch 256 a decode step's cost is the float32 recurrent states: 1 MiB per
sequence per linear layer for Qwen3.5-0.8B (16 value heads of 128 x 128), ~10 GB read and written per
step, more than the weights. The torch path (``qwen3_5.GatedDeltaNet._decode`` with
``gated_delta.recurrent_gated_delta_rule``) passes over each state about eight times: ``index_select`` of
the read slots, ``k^T S``, the decay, the rank-one ``addcmul_``, ``q^T S'``, ``index_copy_`` to the write
slots, plus the temporaries. flash-linear-attention's fused recurrent kernel reads and writes a state
once, but takes it as a dense [batch, heads, k_dim, v_dim] input and returns a new one: the engine's
states live in a slot-indexed cache (``state_cache.StateCache``; double buffered under async
scheduling), so it would need a gather before and a scatter after it, three times the traffic of a
kernel that indexes the cache itself. This kernel loads each state tile once at its row's read slot and
stores the new tile once at its write slot.

Grid (rows, value heads, v_dim blocks). Each program takes its row's q and k (key head ``h // (v_heads /
k_heads)``, as ``gated_delta.repeat_heads`` pairs them) and a block of v, l2-normalises q and k as
``gated_delta.l2norm`` does (``x / sqrt(sum(x^2) + 1e-6)``, q then scaled by ``k_dim ** -0.5``), loads the
tile ``S[read_slot, h, :, v-block]`` (float32) and computes, as ``recurrent_gated_delta_rule`` does::

    decay = exp(g);  predicted = decay * (k^T S);  u = beta * (v - predicted)
    S' = decay * S + k u^T;  out = q^T S'

then stores ``S'`` at ``S[write_slot, h, :, v-block]`` and the output block (in the inputs' dtype). The
read and write slots are device tensors (``AttentionMetadata.state_slots`` / ``state_write_slots``; equal
for in-place steps) and the grid depends only on the row count, so CUDA graphs capture the launch. A
program reads its tile before writing it and no two programs share a tile, so in-place steps are safe;
padding rows all read and write the scratch slot, whose contents are never used. The results equal the
torch rule's up to float32 summation order (~1e-6).

Before it, ``causal_conv_decode`` (grid rows x channel blocks) runs the step's short depthwise causal conv
and SiLU (``gated_delta.causal_conv``) from the conv history at the read slot and stores the shifted
history at the write slot: one launch instead of the torch path's gather, concatenation, conv1d, SiLU and
scatter. The conv output is rounded to the model dtype before the SiLU, as conv1d's is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A program's tile is k_dim x BLOCK_V float32 (128 x 32 = 16 KiB for Qwen3.5): 32 values per thread on 4
# warps, and 4 programs per (row, head) at v_dim 128, so a batch of 256 launches thousands of programs.
BLOCK_V = 32
NUM_WARPS = 4
L2_EPS = 1e-6  # gated_delta.l2norm's
BLOCK_C = 256  # channels per program of the conv update


@triton.jit
def _decode_kernel(
    mixed_ptr,  # [rows, 2 * k_heads * K + H * V] conv outputs: q | k | v
    mixed_row_stride,
    g_ptr,  # [rows, H] log decay (float32)
    g_row_stride,
    beta_ptr,  # [rows, H]
    beta_row_stride,
    state_ptr,  # [slots, H, K, V] float32, last dimension contiguous
    slot_stride,
    head_stride,
    k_stride,
    read_ptr,  # [rows] slot each row reads
    write_ptr,  # [rows] slot each row writes
    out_ptr,  # [rows, H, V] contiguous
    H,
    K,
    V,
    GROUPS,
    KEY_SIZE,
    scale,
    eps,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < K, offs_v < V
    key_head = h // GROUPS

    mixed = mixed_ptr + row * mixed_row_stride
    q = tl.load(mixed + key_head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(mixed + KEY_SIZE + key_head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(mixed + 2 * KEY_SIZE + h * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
    decay = tl.exp(tl.load(g_ptr + row * g_row_stride + h).to(tl.float32))
    beta = tl.load(beta_ptr + row * beta_row_stride + h).to(tl.float32)

    tile = h * head_stride + offs_k[:, None] * k_stride + offs_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    read = tl.load(read_ptr + row).to(tl.int64)
    state = tl.load(state_ptr + read * slot_stride + tile, mask=mask, other=0.0)
    predicted = tl.sum(k[:, None] * state, 0) * decay  # what the decayed state reads at k
    u = beta * (v - predicted)
    state = state * decay + k[:, None] * u[None, :]
    out = tl.sum(q[:, None] * state, 0)

    write = tl.load(write_ptr + row).to(tl.int64)
    tl.store(state_ptr + write * slot_stride + tile, state, mask=mask)
    tl.store(out_ptr + (row * H + h) * V + offs_v, out.to(out_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _conv_kernel(
    x_ptr,  # [rows, C] the step's q | k | v inputs
    x_row_stride,
    conv_ptr,  # [slots, C, WIDTH - 1] the inputs before, oldest first
    slot_stride,
    channel_stride,
    weight_ptr,  # [C, 1, WIDTH] contiguous
    read_ptr,
    write_ptr,
    out_ptr,  # [rows, C] contiguous
    C,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs_c < C
    read = tl.load(read_ptr + row).to(tl.int64)
    write = tl.load(write_ptr + row).to(tl.int64)
    past = conv_ptr + read * slot_stride + offs_c * channel_stride
    new = conv_ptr + write * slot_stride + offs_c * channel_stride
    x = tl.load(x_ptr + row * x_row_stride + offs_c, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(weight_ptr + offs_c * WIDTH + WIDTH - 1, mask=mask).to(tl.float32)
    # Channel by channel (one layout for every load and store, so each thread rewrites only entries it has
    # already read: in place is safe): input j of the window, then stored one place earlier.
    for j in tl.static_range(WIDTH - 1):
        value = tl.load(past + j, mask=mask, other=0.0)
        acc += value.to(tl.float32) * tl.load(weight_ptr + offs_c * WIDTH + j, mask=mask).to(tl.float32)
        if j > 0:
            tl.store(new + j - 1, value, mask=mask)
    tl.store(new + WIDTH - 2, x, mask=mask)
    conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # conv1d's output, in the model dtype
    out = conv / (1.0 + tl.exp(-conv))  # SiLU
    tl.store(out_ptr + row * C + offs_c, out.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv_decode(
    x: torch.Tensor,
    conv: torch.Tensor,
    weight: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    block_c: int = BLOCK_C,
) -> torch.Tensor:
    """One token per row through the depthwise causal conv and SiLU (``gated_delta.causal_conv`` after the
    history at ``read_slots``), the new history stored at ``write_slots``: x [rows, C] (its dtype is the
    output's and, as in the engine, the weight's), conv [slots, C, width - 1], weight [C, 1, width].
    Returns [rows, C]."""
    rows, channels = x.shape
    width = weight.shape[-1]
    if width < 2 or conv.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(
            "causal_conv_decode needs a width >= 2 and x and the conv states contiguous in their last dimension"
        )
    out = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    grid = (rows, triton.cdiv(channels, block_c))
    _conv_kernel[grid](
        x, x.stride(0), conv, conv.stride(0), conv.stride(1), weight.contiguous(), read_slots, write_slots,
        out, channels, WIDTH=width, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out


def gated_delta_decode(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    k_heads: int,
    block_v: int = BLOCK_V,
) -> torch.Tensor:
    """One token per row: ``mixed`` [rows, 2 * k_heads * k_dim + v_heads * v_dim] (the conv outputs, q then
    k then v), ``g`` and ``beta`` [rows, v_heads], ``state`` [slots, v_heads, k_dim, v_dim] float32 updated
    from ``read_slots`` into ``write_slots`` (int tensors [rows]). Returns the output [rows, v_heads,
    v_dim] in ``mixed``'s dtype."""
    rows = mixed.shape[0]
    _, heads, k_dim, v_dim = state.shape
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("gated_delta_decode needs a float32 state with a contiguous last dimension")
    mixed, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (mixed, g, beta))
    out = torch.empty(rows, heads, v_dim, dtype=mixed.dtype, device=mixed.device)
    block_v = min(block_v, triton.next_power_of_2(v_dim))
    grid = (rows, heads, triton.cdiv(v_dim, block_v))
    _decode_kernel[grid](
        mixed, mixed.stride(0), g, g.stride(0), beta, beta.stride(0),
        state, state.stride(0), state.stride(1), state.stride(2), read_slots, write_slots, out,
        heads, k_dim, v_dim, heads // k_heads, k_heads * k_dim, k_dim**-0.5, L2_EPS,
        BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
