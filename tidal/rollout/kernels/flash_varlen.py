"""Causal flash attention over sequences laid back to back (``[tokens, heads, d]``, sequence ``i`` at rows
``cu[i]:cu[i+1]``): torch's ``varlen_attn`` (``torch.nn.attention.varlen``), adapted to the signature of
the installed torch. No padding and no mask: the kernel reads the boundaries.

Two callers: the engine's prefill (``runner/attention.flash_prefill_attention``) and the trainer's packed
rows (``tidal/models/packed_attention.py``), which also pads a narrower value head dim around the kernel
(``with_equal_head_dims``). CUDA in half precision only: each caller decides where it applies
(``runner/attention.flash_prefill_usable``; ``packed_attention.varlen_attention_forward``).
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
from torch import nn


def kernel_available() -> bool:
    """Whether this torch ships ``varlen_attn`` and a CUDA device exists."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def varlen_params() -> frozenset[str]:
    """``varlen_attn``'s parameter names (they changed across torch releases)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def takes_window() -> bool:
    """Whether the installed ``varlen_attn`` takes a sliding window (torch 2.11's does)."""
    return "window_size" in varlen_params()


def causal_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float | None,
    window: int | None = None,
    params: frozenset[str] | None = None,
) -> torch.Tensor:
    """q [tokens, heads, d], k/v [tokens, kv_heads, d], ``cu`` [sequences + 1] int32 -> [tokens, heads, d]:
    each query attends its own sequence's keys up to itself (``window``: its own and the ``window - 1``
    before it, as a sliding-window layer; needs ``takes_window``). ``params``: ``varlen_params()``, passed
    by a caller that torch.compile traces (it reads them from a plain global)."""
    from torch.nn.attention.varlen import varlen_attn

    params = varlen_params() if params is None else params
    extra: dict = {}
    if "window_size" in params:
        extra["window_size"] = (-1 if window is None else window - 1, 0)  # (-1, 0): causal
    elif window is not None:
        raise ValueError("causal_varlen: this torch's varlen_attn takes no sliding window")
    else:
        extra["is_causal"] = True
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        extra["enable_gqa"] = True  # the flash kernel takes fewer kv heads as they are; newer torch asks
    default_scale = q.shape[-1] ** -0.5
    if "scale" in params:
        extra["scale"] = scale
    elif scale is not None and abs(scale - default_scale) > 1e-12:
        q = q * (scale / default_scale)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)


def with_equal_head_dims(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``kernel(q, k, v)`` for a kernel that needs one head dim for all three (flash varlen does), when the
    value head dim differs from the query/key one (DeepSeek-V3's MLA: v 128, q/k 192).

    The narrower side is zero-padded in its last dim and the output cut back to v's width. Exact: zero
    channels in q and k add nothing to a dot product, and an output channel is a weighted sum of the same
    value channel, so v's zero channels come out zero. ``kernel`` must not derive its scale from q's
    (padded) width."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if qk_dim == v_dim:
        return kernel(q, k, v)
    width = max(qk_dim, v_dim)
    q, k = (nn.functional.pad(t, (0, width - qk_dim)) for t in (q, k))
    out = kernel(q, k, nn.functional.pad(v, (0, width - v_dim)))
    return out[..., :v_dim]
