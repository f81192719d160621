"""The attention of Qwen-VL vision towers in the engine: one SDPA call per run of equal-length segments.

transformers' Qwen2.5-VL / Qwen3-VL towers attend within segments of the packed patches (``cu_seqlens``:
each image in full-attention blocks; each window of 8×8 patches in Qwen2.5-VL's window blocks). Without
flash-attention they split the patches and run one SDPA call per segment: a 448×448 image is 16 windows,
so 64 such images are 1,024 calls in each of the 28 window blocks, each call a few small kernels, which
is most of the tower's time on a GPU (issue #32). ``segment_attention`` does the same math in one call
per run of consecutive segments of one length: the run's queries, keys and values are viewed as a batch
of segments ``[segments, heads, length, dim]`` (a batch row is exactly one segment's own attention, as
the per-segment call computes it; no mask, nothing across segments). Equal-size images give one call
per block; ragged ones fall back towards a call per segment.

transformers hands packed segments (``cu_seq_lens_q``) only to an attention whose name contains
"flash" (``is_flash_attention_requested``), so the function is registered under ``SEGMENT_ATTENTION``;
``build_vision_tower`` builds a tower that attends through it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

SEGMENT_ATTENTION = "tidal_segments_flash_layout"  # "flash": transformers passes cu_seqlens to it


def equal_length_runs(lengths: list[int]) -> list[tuple[int, int, int]]:
    """``(first token, segment length, segments)`` of each maximal run of consecutive equal lengths
    (empty segments dropped): ``[64, 64, 16, 64]`` -> ``[(0, 64, 2), (128, 16, 1), (144, 64, 1)]``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for n in lengths:
        if n > 0:
            if runs and runs[-1][1] == n:
                first, _, count = runs[-1]
                runs[-1] = (first, n, count + 1)
            else:
                runs.append((start, n, 1))
        start += n
    return runs


# The towers pass the same two cu_seqlens tensors (images, windows) to every block of a forward: their
# lengths are read to the host once each (a read waits for the GPU), not once per block.
_LENGTHS: list[tuple[torch.Tensor, list[int]]] = []


def _segment_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    for tensor, lengths in _LENGTHS:
        if tensor is cu_seqlens:  # the very tensor (held here, so its id is not reused): not modified
            return lengths
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    _LENGTHS[:] = [*_LENGTHS[-1:], (cu_seqlens, lengths)]
    return lengths


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Bidirectional attention within each packed segment: ``query/key/value`` ``[1, heads, tokens, dim]``
    -> ``[1, tokens, heads, dim]`` (transformers' attention-interface layout). Without ``cu_seq_lens_q``
    (a transformers release that splits the segments itself) the input is one segment, as SDPA takes it."""
    if dropout:
        raise ValueError(f"{SEGMENT_ATTENTION} is for inference: dropout must be 0, got {dropout}")
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
        return out.transpose(1, 2), None
    if attention_mask is not None:
        raise ValueError(f"{SEGMENT_ATTENTION}: packed segments (cu_seqlens) take no attention mask")
    heads, dim = query.shape[1], query.shape[3]
    lengths = _segment_lengths(cu_seq_lens_q)
    outs = []
    for first, length, count in equal_length_runs(lengths):
        rows = slice(first, first + length * count)
        q, k, v = (x[0, :, rows].unflatten(1, (count, length)).transpose(0, 1) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)  # [count, heads, length, dim]
        outs.append(out.permute(0, 2, 1, 3).reshape(count * length, heads, dim))
    return torch.cat(outs)[None] if len(outs) > 1 else outs[0][None], None


def build_vision_tower(tower_class: type, vision_config) -> nn.Module:
    """``tower_class._from_config`` on a copy of ``vision_config`` (the caller's model, e.g. the HF model
    the engine was built from, keeps its attention), then switched to ``segment_attention``, unless the
    config asks for a flash-attention kernel (which takes the packed segments in one call already).
    Switched after building: transformers' checks at build time take a "flash" name for a hub kernel."""
    from transformers import AttentionInterface

    tower = tower_class._from_config(copy.deepcopy(vision_config))
    if "flash" not in (tower.config._attn_implementation or ""):
        AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
        tower.config._attn_implementation = SEGMENT_ATTENTION  # the blocks share the tower's config
    return tower
