"""Batch-invariant pointwise ops, RMSNorm and RoPE.

Transcendental pointwise ops (exp, log, rsqrt, cos, sin, SiLU): ATen runs a vectorised (SLEEF) loop and
finishes the tail of a tensor with the scalar libm function, which can differ by an ulp; so the same value
could round differently in a 1-token decode than in a 100-token prefill. ``pointwise`` runs the op on
zero-padded blocks of ``POINT_BLOCK`` elements (a multiple of every vector width, below ATen's parallel
grain), so every element takes the vector path (on CUDA an elementwise kernel computes every element with
the same code, so it calls the op directly). RMSNorm's mean over the last dimension is reduced in an order
that depends only on that length; on CUDA it runs the fixed-configuration Triton kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidal.rollout.batch_invariant import dispatch

POINT_BLOCK = 4096  # elements per pointwise call (ATen's parallel grain is 32768)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (an elementwise op) over ``x``, every element on the vectorised path (see the module doc)."""
    if x.is_cuda:  # every element through the same code already
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    whole = n - n % POINT_BLOCK  # whole blocks run in place (views); only the last one is padded
    parts = [fn(block) for block in flat[:whole].split(POINT_BLOCK)]
    if whole < n:
        last = flat.new_zeros(POINT_BLOCK)
        last[: n - whole] = flat[whole:]
        parts.append(fn(last)[: n - whole])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_float32: bool = False
) -> torch.Tensor:
    """Llama's RMSNorm (normalise in float32; scale after rounding to ``x``'s dtype unless
    ``scale_in_float32``), with a row-invariant mean and rsqrt. The weight is used in ``x``'s dtype."""
    weight = weight.to(x.dtype)
    if dispatch.on_triton(x):
        return dispatch.invariant(
            lambda a, w: dispatch.kernels().rms_norm(a, w, eps, scale_in_float32),
            lambda a, w: _torch_rms_norm(a, w, eps, scale_in_float32),
            x,
            weight,
        )
    x32 = x.float()
    x32 = x32 * pointwise(torch.rsqrt, x32.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (weight * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


def _torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_float32: bool
) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (weight.float() * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[*positions.shape, head_dim]`` (rotate-half layout) of integer ``positions``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device, torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (pointwise(torch.cos, emb) * scale).to(dtype), (pointwise(torch.sin, emb) * scale).to(dtype)
