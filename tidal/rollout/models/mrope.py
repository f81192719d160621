"""Multimodal rotary positions (Qwen-VL's M-RoPE) in the engine: a prefill step passes ``[3, tokens]``
(temporal, height, width) position triples, whose cos/sin are taken per channel from the axis
``rope_axis`` names; a decode step passes plain positions, shifted by its sequence's decode delta (max
position + 1 − prompt length, set at prefill), kept per KV block id in ``block_deltas`` and read at the
sequence's first block. Shared by every Qwen-VL family (``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5``)."""

from __future__ import annotations

import torch

from tidal.rollout.runner.attention import AttentionMetadata


class MRopeMixin:
    """``reserve_block_state`` and ``rope`` for a model with ``rotary`` tables and a ``rope_axis``."""

    rope_axis: torch.Tensor
    block_deltas: torch.Tensor

    def reserve_block_state(self, num_blocks: int) -> None:
        """The decode-delta table, one entry per KV block id (``ModelRunner`` calls it once)."""
        self.block_deltas = torch.zeros(num_blocks, dtype=torch.int64, device=self.rope_axis.device)

    def rope(self, positions, meta: AttentionMetadata, dtype: torch.dtype):
        if positions.dim() == 2:  # prefill: [3, tokens] position triples
            cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]  # [3, tokens, rotary_dim]
            index = self.rope_axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
            return cos.gather(0, index)[0].to(dtype), sin.gather(0, index)[0].to(dtype)
        delta = self.block_deltas[meta.block_tables[:, 0].long()]
        limit = self.rotary.cos.shape[0] - 1
        return self.rotary((positions + delta).clamp(0, limit), dtype)
