"""The paged decode-attention kernel (``tidal/rollout/kernels/triton_attention.py``) run by Triton's interpreter on
the CPU, against the torch decode path: context splits cut per sequence (also where the block table is far
wider than the context, as in a CUDA graph), sliding windows, padding rows, strided queries. Skipped where
triton is missing (CI) or CUDA is present (``tests/rollout/test_gpu.py`` runs the compiled kernel there).
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.triton_interpreter import interpreted
from tidal.rollout.runner.attention import AttentionMetadata, torch_decode_attention


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window, splits",
    [(14, 2, 64, None, 1), (8, 4, 32, 7, 2), (12, 4, 32, None, 4), (6, 3, 32, 9, 8)],
)
def test_interpreted_kernel_matches_torch(heads, kv_heads, head_dim, window, splits):
    with interpreted({"tidal.rollout.kernels.triton_attention": "_decode_kernel"}) as (module,):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window, splits",
    [(14, 2, 64, None, 1), (8, 4, 32, 7, 2), (6, 3, 16, None, 4), (4, 4, 16, 5, 8)],
)
def test_fused_rope_decode_is_bit_equal_to_rope_store_then_attention(
    dtype, heads, kv_heads, head_dim, window, splits
):
    """``paged_decode_attention(rope=...)`` = ``rope_store_kv`` + ``paged_decode_attention``: the same output and
    cache bits, with the step's own key/value (the last context position) stored and read in one kernel
    (whichever split holds it), a padding row storing into its slot, GQA groups and sliding windows."""
    kernels = {
        "tidal.rollout.models.triton_fused": "_rope_store_kv_kernel",
        "tidal.rollout.kernels.triton_attention": "_decode_kernel",
    }
    with interpreted(kernels) as (tf, module):
        gen = torch.Generator().manual_seed(heads + splits)
        batch, blocks, block_size, width = 4, 64, 4, 16
        cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        tables = torch.stack([torch.randperm(blocks - 1, generator=gen)[:width] for _ in range(batch)])
        ctx = torch.tensor([40, 1, 0, 13], dtype=torch.int32)
        pad_slot = (blocks - 1) * block_size  # the last block is nobody's: the padding row's slot
        pos = (ctx - 1).clamp(min=0).long()
        slots = torch.where(
            ctx > 0, tables[torch.arange(batch), pos // block_size] * block_size + pos % block_size, pad_slot
        )
        qkv = (torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
        angles = torch.rand(batch, head_dim // 2, generator=gen) * 100
        cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
        tiles = module.Tiles(block_n=8, num_warps=1, num_stages=1)
        scale = head_dim**-0.5

        ref_cache = cache.clone()
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(batch, -1, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(batch, kv_heads, head_dim)
        q, _ = tf.rope_store_kv(qk, v, cos, sin, heads, ref_cache, slots)
        ref = module.paged_decode_attention(q, ref_cache, tables.int(), ctx, window, scale, splits, tiles)

        rope = module.RopeInputs(cos, sin, slots)
        packed = qkv.view(batch, -1, head_dim)
        out = module.paged_decode_attention(
            packed, cache, tables.int(), ctx, window, scale, splits, tiles, rope
        )
        assert torch.equal(cache, ref_cache)  # k (rotated) and v stored once each, nothing else touched
        assert torch.equal(out, ref)
        # The kernel stores before it reads: a cache whose step slot was wiped still gives the same result.
        stale = ref_cache.clone()
        stale[:, slots[0] // block_size, slots[0] % block_size] = 0
        missing = module.paged_decode_attention(
            packed, stale, tables.int(), ctx, window, scale, splits, tiles, rope
        )
        assert torch.equal(missing, ref) and torch.equal(stale, ref_cache)
