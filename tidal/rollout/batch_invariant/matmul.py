"""Batch-invariant ``linear``: torch's CPU GEMM gives a row a different result for 1 row (a GEMV path) than
for 2+ rows, so ``linear`` pads the rows to a multiple of ``ROW_BLOCK`` and multiplies blocks of exactly
that many rows (one batched call): every row goes through the same kernel shape. Measured: a row's result
does not depend on its place in the block or the other rows. It can depend on how many output columns
share the call (torch 2.13 / MKL, float32, K = 896: a q/k/v packed into 1152 columns gives q other bits
than q's 896 alone; K = 2048 in bf16 too), so ``linear_parts`` multiplies each part on its own.
On CUDA it runs the Triton GEMM whose K partition is fixed per weight (``triton_exact.matmul_config``).
"""

from __future__ import annotations

import torch

from tidal.rollout.batch_invariant import dispatch

ROW_BLOCK = 16  # rows per GEMM call


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` over ``x [..., K]``, with every row computed in a ``ROW_BLOCK``-row GEMM
    (on CUDA: the fixed-tile Triton GEMM). The weight and bias are used in ``x``'s dtype (the compute
    dtype: a trainer's float32 master weights rounded once, as the engine's copy is)."""
    shape = x.shape
    weight = weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if dispatch.on_triton(x):
        rows = x.reshape(-1, shape[-1])
        wanted = (rows, weight) if bias is None else (rows, weight, bias)
        if torch.is_grad_enabled() and any(t.requires_grad for t in wanted):
            out = _Linear.apply(rows, weight)
            out = out if bias is None else out + bias
        else:  # the bias in the GEMM's epilogue: the same bits as the separate add, one kernel fewer
            out = dispatch.kernels().matmul(rows, weight, bias)
        return out.view(*shape[:-1], weight.shape[0])
    rows = x.reshape(-1, shape[-1])
    m = rows.shape[0]
    blocks = _row_blocks(rows)
    out = torch.bmm(blocks, weight.t().expand(blocks.shape[0], *weight.t().shape)).view(-1, weight.shape[0])
    out = out[:m]
    if bias is not None:  # a separate add: addmm's fused bias could round differently
        out = out + bias
    return out.view(*shape[:-1], weight.shape[0])


def _row_blocks(rows: torch.Tensor) -> torch.Tensor:
    """``rows [m, K]`` as ``[-1, ROW_BLOCK, K]``, zero rows padding the last block. Whole blocks of a
    contiguous, 64-byte aligned tensor (a decode step of 16·n rows) are a view: the same values at the same
    alignment as the padded copy (torch's allocator aligns to 64 bytes), so the same bits, one copy fewer."""
    m, k = rows.shape
    if m % ROW_BLOCK == 0 and m and rows.is_contiguous() and rows.data_ptr() % 64 == 0:
        return rows.view(-1, ROW_BLOCK, k)
    padded = rows.new_zeros(-(-m // ROW_BLOCK) * ROW_BLOCK, k)
    padded[:m] = rows
    return padded.view(-1, ROW_BLOCK, k)


def linear_parts(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]
) -> torch.Tensor:
    """A packed projection (``weight``'s rows: parts of ``sizes`` rows, as the engine's fused q/k/v) with
    each part computed as ``linear`` computes it alone (the trainer's separate layers), side by side in
    one ``[..., sum(sizes)]`` output. On CUDA without a gradient: at a decode step's rows one launch over
    the packed weight where ``triton_exact.verify_decode_launch`` has seen that launch give every part's
    columns the part's own bits; otherwise each part's GEMM writes its own columns (no concatenation
    copy). Elsewhere the parts are concatenated."""
    bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    parts = [(weight[a:b], None if bias is None else bias[a:b]) for a, b in bounds]
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if not dispatch.on_triton(x) or grad:
        return torch.cat([linear(x, w, b) for w, b in parts], dim=-1)
    rows = x.reshape(-1, x.shape[-1])
    te = dispatch.kernels()
    if rows.shape[0] <= te.DECODE_ROWS and te.decode_launch_verified(weight, x.dtype):
        # one launch over the packed weight: verified to give each part's columns its own launch's bits
        out = te.matmul(rows, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return out.view(*x.shape[:-1], out.shape[-1])
    out = torch.empty(rows.shape[0], sum(sizes), dtype=x.dtype, device=x.device)
    for (a, b), (w, bias_part) in zip(bounds, parts, strict=True):
        bias_part = None if bias_part is None else bias_part.to(x.dtype)
        dispatch.kernels().matmul(rows, w.to(x.dtype), bias_part, out=out[:, a:b])
    return out.view(*x.shape[:-1], out.shape[-1])


class _Linear(torch.autograd.Function):
    """The GEMM kernel; its gradients ``grad @ w`` and ``grad^T @ x`` (torch's GEMMs: no forward to redo)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return dispatch.kernels().matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        return grad_x, grad_w
