"""Padding-free attention for packed rows on CUDA: torch's flash-attention varlen kernel inside HF models.

A packed row holds several samples back to back (``[1, ΣT]``, see ``tidal.data.collate``). On the CPU
``forward.packed_attention_mask`` hands HF a ``[1, 1, ΣT, ΣT]`` block-diagonal mask; on CUDA that mask
costs O((ΣT)²) memory and keeps SDPA off its flash kernels (they take no mask). So for CUDA we register
an attention implementation, ``tidal_varlen``, with transformers' ``AttentionInterface``: given
flash-attention-style ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments (the names HF's own
flash-attention path uses) it runs ``torch.nn.attention.varlen.varlen_attn`` (causal, per sample, no
mask at all; a value head dim other than the query's, as DeepSeek-V3's, is zero-padded around the
kernel by ``with_equal_head_dims``); without them it *is* HF's SDPA path, so padded batches, generation
and everything else behave exactly as before. ``enable_varlen_attention`` switches a model from ``sdpa`` to it.

Measured against FlexAttention with a document block mask and SDPA with the 4-D mask in
``bench/train_step.py`` (docs/benchmarks.md, issue #8).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from tidal.rollout.kernels.flash_varlen import (  # the kernel's wrapper, shared with the engine's prefill
    causal_varlen,
    kernel_available,
    varlen_params,
    with_equal_head_dims,
)

VARLEN = "tidal_varlen"
_FLASH_DTYPES = (torch.bfloat16, torch.float16)


_VARLEN_PARAMS: frozenset[str] | None = None  # varlen_attn's parameter names, set by register()


@cache
def register() -> None:
    """Register ``tidal_varlen`` with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, _mask)
    global _VARLEN_PARAMS
    _VARLEN_PARAMS = varlen_params()  # read as a plain global where torch.compile traces _varlen


def enable_varlen_attention(model: nn.Module, force: bool = False) -> bool:
    """Switch ``model`` from ``sdpa`` to ``tidal_varlen``; True if it now runs packed rows varlen.

    Only SDPA models switch (eager and flash-attention models keep their implementation). ``force``
    skips the CUDA check, for CPU tests of the plumbing (the kernel then falls back to a mask).
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == VARLEN:
        return True
    if impl != "sdpa" or not (force or kernel_available()):
        return False
    register()
    config._attn_implementation = VARLEN  # read by every attention layer at call time
    return True


def _mask(*args, attention_mask=None, **kwargs):
    """HF mask factory for ``tidal_varlen``: SDPA's mask for padded batches; none for packed rows,
    whose sample boundaries travel as ``cu_seq_lens`` instead."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """HF attention signature: ``query`` ``[B, H, T, D]`` → ``([B, T, H, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    dtype = attention_dtype(query)
    usable = (
        query.is_cuda
        and query.shape[0] == 1
        and dtype in _FLASH_DTYPES
        and sliding_window is None
        and not (dropout > 0 and module.training)
    )
    if not usable:  # fp32, CPU, sliding window or dropout: the same math through a materialised mask
        mask = _block_causal_mask(cu, query.shape[2], query.device, sliding_window)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))  # [T, H, D]
    cu, max_len = cu.to(torch.int32), int(kwargs["max_length_q"])
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5  # fixed before any padding of q
    out = with_equal_head_dims(lambda q, k, v: _varlen(q, k, v, cu, max_len, scale), q, k, v)
    return out[None], None


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype a custom attention kernel runs ``query`` in (autocast's, where it is on)."""
    # Under autocast RoPE leaves q/k in float32 (cos/sin are float32); SDPA would be cast by autocast,
    # a custom op is not, so cast to autocast's dtype ourselves.
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def _varlen(q, k, v, cu: torch.Tensor, max_len: int, scaling: float | None) -> torch.Tensor:
    """Causal varlen flash attention (``flash_varlen.causal_varlen``), given the parameter names that
    ``register`` stored in a plain global (None before it ran: the wrapper reads them itself)."""
    return causal_varlen(q, k, v, cu, max_len, scaling, params=_VARLEN_PARAMS)


def _block_causal_mask(
    cu: torch.Tensor, length: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """``[1, 1, T, T]`` boolean mask: causal within each ``cu`` segment, within ``window`` keys of a
    sliding-window layer (the fallback path)."""
    seg = torch.zeros(length, dtype=torch.long, device=device)
    seg[cu[1:-1].long()] = 1
    seg = seg.cumsum(0)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if window is not None:
        causal = causal.triu(1 - window)
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def varlen_kwargs(batch: dict) -> dict:
    """``cu_seq_lens_q/k`` and ``max_length_q/k`` of a packed ``[1, ΣT]`` batch.

    Uses the collator's ``cu_seqlens`` when present, else counts ``segment_ids`` (contiguous 0..n-1,
    as ``tidal.experience.model_batch`` makes them). ``max_length`` costs one host sync.
    """
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].to(batch["input_ids"].device, torch.int32)
        lengths = cu[1:] - cu[:-1]
    else:
        lengths = torch.bincount(batch["segment_ids"][0])
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    max_len = int(lengths.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
