"""On CUDA the batch-invariant ops run Triton kernels (``tidal.rollout.kernels.triton_exact``): this module picks
them (``on_triton``) and makes a kernel differentiable by recomputing a plain torch formulation backward
(``invariant``), which needs no invariance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def on_triton(x: torch.Tensor) -> bool:
    """Whether ``x``'s op runs the Triton kernels (CUDA); the interpreter tests switch CPU tensors over."""
    return x.is_cuda


def kernels():
    """``tidal.rollout.kernels.triton_exact``, imported only where a kernel runs (Triton is optional)."""
    from tidal.rollout.kernels import triton_exact

    return triton_exact


class _Recompute(torch.autograd.Function):
    """``fast(*tensors)`` forward; the gradient of ``reference(*tensors)`` (recomputed) backward."""

    @staticmethod
    def forward(ctx, fast, reference, *tensors):
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        return fast(*tensors)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return None, None, *(next(grads) if t.requires_grad else None for t in inputs)


def invariant(fast: Callable, reference: Callable, *tensors: torch.Tensor) -> torch.Tensor:
    """``fast(*tensors)`` (a batch-invariant kernel), differentiable through ``reference`` (the same
    function in plain torch) when a gradient is wanted."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Recompute.apply(fast, reference, *tensors)
    return fast(*tensors)
