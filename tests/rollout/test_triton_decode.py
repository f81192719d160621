"""The paged decode-attention kernel (``tidal/rollout/triton_attention.py``) run by Triton's interpreter on
the CPU, against the torch decode path: context splits cut per sequence (also where the block table is far
wider than the context, as in a CUDA graph), sliding windows, padding rows, strided queries. Skipped where
triton is missing (CI) or CUDA is present (``tests/rollout/test_gpu.py`` runs the compiled kernel there).
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.triton_interpreter import interpreted
from tidal.rollout.attention import AttentionMetadata, torch_decode_attention


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window, splits",
    [(14, 2, 64, None, 1), (8, 4, 32, 7, 2), (12, 4, 32, None, 4), (6, 3, 32, 9, 8)],
)
def test_interpreted_kernel_matches_torch(heads, kv_heads, head_dim, window, splits):
    with interpreted({"tidal.rollout.triton_attention": "_decode_kernel"}) as (module,):
        gen = torch.Generator().manual_seed(0)
        batch, blocks, block_size, width = 4, 64, 4, 16  # tables 64 tokens wide, contexts up to 40
        cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen)
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in range(batch)])
        ctx = torch.tensor([40, 1, 0, 13], dtype=torch.int32)
        q = torch.randn(batch, heads + 1, head_dim, generator=gen)[:, :heads]  # strided rows, as the engine's
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=None, kv_cache=cache[None], block_tables=tables, context_lens=ctx
        )
        ref = torch_decode_attention(q, cache, meta, window, head_dim**-0.5)
        tiles = module.Tiles(block_n=8, num_warps=1, num_stages=1)
        out = module.paged_decode_attention(
            q, cache, tables.to(torch.int32), ctx, window, head_dim**-0.5, splits, tiles
        )
        live = ctx > 0
        torch.testing.assert_close(out[live], ref[live], atol=1e-5, rtol=1e-5)
        assert (out[~live] == 0).all()  # a padding row reads nothing
