"""Triton kernels for the chunked LM head on CUDA: log-prob of the target token, and its gradient.

The torch version of a chunk (``logprob_head``) upcasts the ``[chunk, vocab]`` logits to float32 and
makes several passes over them (divide by T, max, subtract, exp, sum, gather; in backward exp,
multiply, scatter, cast back): with a 152k vocabulary that is gigabytes of memory traffic per chunk,
more time than the head's matmul. These kernels read the logits once in their own dtype:

- ``logprobs_lse``: per row, a running max and sum of ``exp(z / T)`` (online logsumexp) and the
  target's ``z / T``; returns ``(log-prob of the target, logsumexp)`` in float32;
- ``softmax_grad_``: per row, ``g · (onehot(target) − softmax(z / T)) / T`` written over ``z`` in
  place (the gradient of the log-prob w.r.t. the logits), in ``z``'s dtype, ready for the backward
  matmuls.

Values agree with the torch path to float32 rounding (the sums run in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _logprobs_kernel(z_ptr, stride, targets_ptr, logp_ptr, lse_ptr, vocab, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), -3.0e38, tl.float32)  # finite: exp(-inf - -inf) would be nan
    run_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_temp
        new_max = tl.maximum(run_max, x)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
        run_max = new_max
    top = tl.max(run_max, 0)
    lse = top + tl.log(tl.sum(run_sum * tl.exp(run_max - top), 0))
    target = tl.load(targets_ptr + row)
    x_target = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, x_target - lse)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _softmax_grad_kernel(z_ptr, stride, targets_ptr, lse_ptr, grad_ptr, vocab, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_ptr + row).to(tl.float32)
    target = tl.load(targets_ptr + row)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        valid = idx < vocab
        x = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(x - lse)
        out = (tl.where(idx == target, g, 0.0) - g * p) * inv_temp
        tl.store(base + idx, out.to(z_ptr.dtype.element_ty), mask=valid)


def _rows(z: torch.Tensor) -> torch.Tensor:
    return z if z.stride(-1) == 1 else z.contiguous()


def logprobs_lse(
    z: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log softmax(z / T)[targets], logsumexp(z / T))``, both float32 ``[rows]``, for CUDA ``z``."""
    z = _rows(z)
    rows, vocab = z.shape
    logp = torch.empty(rows, dtype=torch.float32, device=z.device)
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows:
        _logprobs_kernel[(rows,)](z, z.stride(0), targets, logp, lse, vocab, 1.0 / temperature, BLOCK=BLOCK)
    return logp, lse


def softmax_grad_(
    z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Overwrite contiguous CUDA ``z`` with ``grad · (onehot(targets) − softmax(z / T)) / T``; return it."""
    rows, vocab = z.shape
    if rows:
        grad = grad.contiguous()
        _softmax_grad_kernel[(rows,)](
            z, z.stride(0), targets, lse, grad, vocab, 1.0 / temperature, BLOCK=BLOCK
        )
    return z
