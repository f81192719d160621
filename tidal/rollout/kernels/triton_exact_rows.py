"""Exact mode's row reductions on CUDA (``triton_exact`` re-exports them): ``rms_norm``, one program per row,
optionally adding the residual in the same launch; ``token_logprobs``, ``VOCAB_CHUNK`` slices of a row's
vocabulary in parallel programs, each walked in ``VOCAB_BLOCK`` steps (max, then sum of exponentials),
their results combined in slice order by a second launch. The slices and steps are set by the row's
length alone, so a row's result does not depend on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One configuration each: changing one changes results (on both sides alike), never correctness.
NORM_BLOCK = 1024
VOCAB_BLOCK = 2048
VOCAB_CHUNK = 8 * VOCAB_BLOCK  # vocabulary per log-softmax program (a 152k vocabulary: 10 per row)


# Reductions over a loaded row (norm, log-softmax) sum in an order set by the load's register layout, which
# Triton picks from the pointers' and strides' known alignment: not specialising on it keeps one order
# whatever the caller's tensors (a view at an odd offset included).
@triton.jit(do_not_specialize=["stride_x"], do_not_specialize_on_alignment=["x_ptr", "res_ptr"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, total_ptr, N: tl.constexpr, stride_x, stride_o, eps,
    BLOCK: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    # A float argument is float32 when Triton launches the kernel itself, float64 when torch.compile's
    # inductor does (the trainer's exact forward under --torch_compile): round it to float32 first, so
    # both add in float32 and give the same bits (no-op in the first case).
    eps = tl.full((), eps, tl.float32)
    offs = tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + offs
        x = _norm_input(x_ptr, res_ptr, total_ptr, row, c, N, stride_x, stride_o, dtype, RESIDUAL, True)
        squares += x * x
    inv = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / N + eps)
    for c0 in range(0, N, BLOCK):
        c = c0 + offs
        x = _norm_input(x_ptr, res_ptr, total_ptr, row, c, N, stride_x, stride_o, dtype, RESIDUAL, False)
        # the weight in the activations' dtype, as the engine (bf16 weights) holds it
        w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(dtype).to(tl.float32)
        y = x * inv
        if SCALE_IN_FLOAT32:
            out = w * y
        else:
            out = w * y.to(dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + c, out.to(dtype), mask=c < N)


@triton.jit
def _norm_input(
    x_ptr, res_ptr, total_ptr, row, c, N, stride_x, stride_o,
    dtype: tl.constexpr, RESIDUAL: tl.constexpr, STORE: tl.constexpr,
):  # fmt: skip
    """Columns ``c`` of the norm's input row, float32: ``x``, or with ``RESIDUAL`` the sum ``x + residual``
    rounded to the activations' dtype, as torch's add rounds it (stored to ``total`` when ``STORE``)."""
    x = tl.load(x_ptr + row * stride_x + c, mask=c < N, other=0.0)
    if RESIDUAL:
        r = tl.load(res_ptr + row * stride_x + c, mask=c < N, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if STORE:
            tl.store(total_ptr + row * stride_o + c, x, mask=c < N)
    return x.to(tl.float32)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scale_in_float32: bool,
    residual: torch.Tensor | None = None,
):
    """RMSNorm of each row of ``x [..., N]`` (statistics in float32), out in ``x``'s dtype. With ``residual``
    (``x``'s shape and dtype): (the norm of ``x + residual``, that sum), the add in the same launch."""
    rows = x.reshape(-1, x.shape[-1])
    res = rows if residual is None else residual.reshape(rows.shape)
    if rows.stride(-1) != 1 or res.stride() != rows.stride():
        rows, res = rows.contiguous(), res.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight.contiguous(), out, total, rows.shape[1], rows.stride(0), out.stride(0),
            float(eps), BLOCK=NORM_BLOCK, SCALE_IN_FLOAT32=scale_in_float32, RESIDUAL=residual is not None,
            num_warps=4,
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), total.view(x.shape)


@triton.jit(do_not_specialize=["stride_l"], do_not_specialize_on_alignment=["logits_ptr"])
def _lse_part_kernel(
    logits_ptr, temp_ptr, part_ptr, V: tl.constexpr, stride_l, CHUNK: tl.constexpr, PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (row, part): the max and the sum of exponentials (from that max) of ``logits / T`` over the
    # part's vocabulary slice [part * CHUNK, (part + 1) * CHUNK), walked in BLOCK steps; stored for
    # ``_lse_finish_kernel``. The slices are set by V alone, never by the row count.
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    temp = tl.full((BLOCK,), 1.0, tl.float32) * tl.load(temp_ptr + row)
    offs = tl.arange(0, BLOCK)
    base = logits_ptr + row * stride_l
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    for v0 in range(part * CHUNK, part * CHUNK + CHUNK, BLOCK):
        c = v0 + offs
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, tl.math.div_rn(z, temp))
    m = tl.max(top, axis=0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(part * CHUNK, part * CHUNK + CHUNK, BLOCK):
        c = v0 + offs
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        zt = tl.math.div_rn(z, temp)
        # -inf logits (and the lanes past V) add nothing, also in a slice of only -inf (m = -inf)
        total += tl.where(zt > float("-inf"), tl.exp(zt - m), 0.0)
    tl.store(part_ptr + row * (2 * PARTS) + part, m)
    tl.store(part_ptr + row * (2 * PARTS) + PARTS + part, tl.sum(total, axis=0))


@triton.jit
def _lse_finish_kernel(
    logits_ptr, tokens_ptr, temp_ptr, part_ptr, out_ptr, stride_l, PARTS: tl.constexpr,
    PARTS_POW2: tl.constexpr,
):  # fmt: skip
    # Per row: the parts' sums rescaled to their common max and added in one fixed order, then the token's
    # log-prob.
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, PARTS_POW2)
    tops = tl.load(part_ptr + row * (2 * PARTS) + p, mask=p < PARTS, other=float("-inf"))
    sums = tl.load(part_ptr + row * (2 * PARTS) + PARTS + p, mask=p < PARTS, other=0.0)
    m = tl.max(tops, axis=0)
    lse = m + tl.log(tl.sum(tl.where(p < PARTS, sums * tl.exp(tops - m), 0.0), axis=0))
    token = tl.load(tokens_ptr + row)
    z_token = tl.load(logits_ptr + row * stride_l + token).to(tl.float32)
    tl.store(out_ptr + row, tl.math.div_rn(z_token, tl.load(temp_ptr + row)) - lse)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens`` (float32) per row of ``logits [..., V]``;
    ``temperature`` (float32) broadcasts against ``logits.shape[:-1]``. Each row's vocabulary is reduced in
    ``VOCAB_CHUNK`` slices by parallel programs (a decode step has too few rows to fill the GPU with one
    program a row), the slices' results combined in slice order."""
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    temps = temperature.to(torch.float32).expand(lead).reshape(-1).contiguous()
    toks = tokens.expand(lead).reshape(-1).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)
    vocab = rows.shape[1]
    parts = triton.cdiv(vocab, VOCAB_CHUNK)
    partials = torch.empty(rows.shape[0], 2 * parts, dtype=torch.float32, device=logits.device)
    if rows.shape[0]:
        _lse_part_kernel[(rows.shape[0], parts)](
            rows, temps, partials, vocab, rows.stride(0), CHUNK=VOCAB_CHUNK, PARTS=parts, BLOCK=VOCAB_BLOCK,
            num_warps=8,
        )  # fmt: skip
        _lse_finish_kernel[(rows.shape[0],)](
            rows, toks, temps, partials, out, rows.stride(0), PARTS=parts,
            PARTS_POW2=max(2, triton.next_power_of_2(parts)), num_warps=1,
        )  # fmt: skip
    return out.view(lead)
