"""Qwen-VL vision towers' attention, engine and trainer: one SDPA call per run of equal-length segments.

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
"flash" (``is_flash_attention_requested``), so the function is registered under ``SEGMENT_ATTENTION``:

- ``build_vision_tower`` builds the engine's tower (on a copy of the config) that attends through it;
- ``use_segment_attention`` switches the towers of a loaded ``AutoModelForImageTextToText`` (the trainer's
  actor, reference, reward model, critic; ``tidal.models.loading``) in place. Only the tower's own config
  changes (the language model's attention stays sdpa or ``--attn_implementation``), and only an SDPA
  tower switches (a flash-attention kernel or eager, as the user asked, is left alone). Forward and
  backward are the per-segment path's: each batch row is a segment's own SDPA call (on CPU in float32
  the same bits, loss and gradients: tests/models/test_vision_attention.py).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

SEGMENT_ATTENTION = "tidal_segments_flash_layout"  # "flash": transformers passes cu_seqlens to it
# transformers' towers whose attention takes the packed segments (cu_seqlens) when the config's attention
# name says "flash", and otherwise splits them into one call per segment (Qwen2-VL to Qwen3.5-MoE)
QWEN_VL_TOWERS = frozenset({
    "Qwen2VisionTransformerPretrainedModel", "Qwen2_5_VisionTransformerPretrainedModel", "Qwen3VLVisionModel",
    "Qwen3VLMoeVisionModel", "Qwen3_5VisionModel", "Qwen3_5MoeVisionModel",
})  # fmt: skip


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


@functools.cache
def _untraced_segment_lengths():
    """``_segment_lengths`` kept out of ``--torch_compile``'s traces of the tower's blocks (the cache runs in
    Python). Made on first use: ``torch.compiler.disable`` imports dynamo, which an engine process must not
    pay for at import (tests/test_startup_imports.py)."""
    return torch.compiler.disable(_segment_lengths)


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
        raise ValueError(f"{SEGMENT_ATTENTION}: dropout must be 0 (the towers use none), got {dropout}")
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
        return out.transpose(1, 2), None
    if attention_mask is not None:
        raise ValueError(f"{SEGMENT_ATTENTION}: packed segments (cu_seqlens) take no attention mask")
    heads, dim = query.shape[1], query.shape[3]
    lengths = _untraced_segment_lengths()(cu_seq_lens_q)
    outs = []
    for first, length, count in equal_length_runs(lengths):
        rows = slice(first, first + length * count)
        q, k, v = (x[0, :, rows].unflatten(1, (count, length)).transpose(0, 1) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)  # [count, heads, length, dim]
        outs.append(out.permute(0, 2, 1, 3).reshape(count * length, heads, dim))
    return torch.cat(outs)[None] if len(outs) > 1 else outs[0][None], None


def _attend_by_segments(vision_config) -> bool:
    """Switch a tower's config (which its blocks share) to ``segment_attention``, unless it asks for a
    flash-attention kernel (which takes the packed segments in one call already); whether it switched."""
    from transformers import AttentionInterface

    if "flash" in (vision_config._attn_implementation or ""):
        return False
    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
    vision_config._attn_implementation = SEGMENT_ATTENTION
    return True


def build_vision_tower(tower_class: type, vision_config) -> nn.Module:
    """``tower_class._from_config`` on a copy of ``vision_config`` (the caller's model, e.g. the HF model
    the engine was built from, keeps its attention), then switched to ``segment_attention``, unless the
    config asks for a flash-attention kernel. Switched after building: transformers' checks at build time
    take a "flash" name for a hub kernel."""
    tower = tower_class._from_config(copy.deepcopy(vision_config))
    _attend_by_segments(tower.config)
    return tower


def use_segment_attention(model: nn.Module) -> int:
    """Switch the Qwen-VL towers (``QWEN_VL_TOWERS``) of a loaded model to ``segment_attention``, in place;
    returns how many switched. A tower's config is the model's ``vision_config`` (one object), so only the
    vision side changes; ``_attn_implementation`` is not saved with the model. Only towers that attend
    with SDPA switch (the default; ``--attn_implementation`` eager or a flash kernel stays as it is)."""
    towers = [m for m in model.modules() if type(m).__name__ in QWEN_VL_TOWERS]
    # only SDPA towers: the same kernel, batched; eager or a kernel the user named is left as it is
    return sum(_attend_by_segments(t.config) for t in towers if t.config._attn_implementation == "sdpa")
