"""The paged KV cache's storage: its allocation and size, block copies, and the FP8 cache
(``EngineConfig.kv_cache_dtype = "fp8"``, vLLM's ``kv_cache_dtype``).

In the model dtype (``"auto"``) the cache is one tensor ``[layers, parts, blocks, block_size, heads, dim]``
(``steps.kv_cache_layout``). In FP8 the same tensor holds e4m3 values, and a float32 tensor
``[layers, 2, blocks, block_size, heads]`` holds their dequantization scales: every key and every value row
(one token, one KV head) is quantized when it is stored, with its own scale ``amax(|row|) / 448``.

Why a scale per row rather than vLLM's one per tensor (calibrated, or 1.0 without calibration): a row's
largest element maps to 448, so no key is clamped however large (Qwen2.5's key biases) and no small value
row falls into e4m3's subnormals; the cost is 4 bytes per ``head_dim`` (3% at 128), and the cache still
holds 1.94x the tokens of a bf16 one. Every reader dequantizes: the Triton decode and context kernels
multiply each logit by its key's scale and each probability by its value's scale; the torch paths
(``gather``) dequantize the blocks they gather.
"""

from __future__ import annotations

import torch

from tidal.config.rollout import KV_CACHE_DTYPES  # the flag's choices, defined once, where --help reads them
from tidal.rollout.e4m3 import E4M3, quantize_rows
from tidal.rollout.runner.steps import kv_cache_layout


def kv_cache_dtype_problem(value: str) -> str | None:
    """Why ``value`` is not a KV cache dtype setting (None: it is)."""
    if value in KV_CACHE_DTYPES:
        return None
    return f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {value!r}"


def bytes_per_block(args, block_size: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """KV bytes of one block on one rank (a tensor-parallel rank caches its KV heads only); FP8: one byte
    an element plus a float32 scale a row."""
    parts, heads, dim = kv_cache_layout(args)
    per_row = dim + 4 if fp8 else dim * torch.empty((), dtype=dtype).element_size()
    return args.kv_layers * parts * block_size * heads * per_row


def allocate(
    args, blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cache, scales or None) of ``blocks`` blocks, zeroed (FP8 scales: ones)."""
    parts, heads, dim = kv_cache_layout(args)
    shape = (args.kv_layers, parts, blocks, block_size, heads)
    if not fp8:
        return torch.zeros(*shape, dim, dtype=dtype, device=device), None
    return torch.zeros(*shape, dim, dtype=E4M3, device=device), torch.ones(shape, device=device)


def copy_blocks(
    cache: torch.Tensor, scales: torch.Tensor | None, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy the blocks ``src`` over ``dst`` (int64 device tensors) in every layer, scales with them."""
    cache[:, :, dst] = cache[:, :, src]
    if scales is not None:
        scales[:, :, dst] = scales[:, :, src]


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, heads, dim] -> (e4m3 of its shape, float32 scales [tokens, heads]): one scale a row,
    as FP8 rollouts quantize a token's activations (``e4m3.quantize_rows``; the Triton stores share its
    arithmetic through ``kernels/triton_e4m3.py``, and give the same bits)."""

    q, scales = quantize_rows(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scales.view(x.shape[:-1])


def store(
    layer_cache: torch.Tensor,
    layer_scales: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``attention.store_kv`` into an FP8 layer cache: k and v ([tokens, kv_heads, dim]) quantized a row
    at a time, their scales stored beside them. Byte views: the CPU has no ``index_copy_`` for e4m3."""
    for part, x in enumerate((k, v)):
        q, scales = quantize_heads(x)
        flat = layer_cache[part].view(-1, *x.shape[1:]).view(torch.uint8)
        flat.index_copy_(0, slot_mapping, q.view(torch.uint8))
        layer_scales[part].view(-1, x.shape[1]).index_copy_(0, slot_mapping, scales)


def gather(
    layer_cache: torch.Tensor,
    layer_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Every block of each row's block table, ``[2, batch, slots, kv_heads, dim]`` in ``dtype`` (FP8:
    dequantized in float32, then rounded once to ``dtype``)."""
    batch = block_tables.shape[0]
    blocks = layer_cache.flatten(2).index_select(1, block_tables.view(-1))
    kv = blocks.view(2, batch, -1, *layer_cache.shape[-2:])
    if layer_scales is None:
        return kv
    scales = layer_scales.flatten(2).index_select(1, block_tables.view(-1)).view(*kv.shape[:-1], 1)
    return (kv.float() * scales).to(dtype)
