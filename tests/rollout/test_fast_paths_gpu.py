"""Engine fast paths against plain references on realistic shapes (skipped without a GPU).

Long contexts and model-sized heads, bf16 as served; errors are measured relative to the reference's
size, and each test also shows that a plausible bug (a dropped KV split, a residual not added) would
exceed the tolerance by far.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(14, 2, 64), (28, 4, 128), (40, 8, 128)])
def test_paged_decode_attention_on_long_contexts(dtype, heads, kv_heads, head_dim):
    """Contexts up to 32k tokens in 16-token blocks scattered over the cache, a batch of mixed lengths."""
    from tidal.rollout.kernels.triton_attention import paged_decode_attention
    from tidal.rollout.runner.attention import AttentionMetadata, torch_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(heads)
    block, lens = 16, [32768, 17, 4096, 1, 9000, 31000]
    width = max(lens) // block + 1
    blocks = len(lens) * width
    cache = torch.randn(2, blocks, block, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(len(lens), width).to(torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = (torch.randn(len(lens), heads, head_dim, device="cuda", generator=gen) * 3).to(dtype)

    def reference(context_lens: torch.Tensor) -> torch.Tensor:
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=None, kv_cache=None, block_tables=tables, context_lens=context_lens
        )
        meta.kv_cache = cache[None].float()
        return torch_decode_attention(q.float(), cache.float(), meta, None, head_dim**-0.5).view(
            len(lens), heads, -1
        )

    ref = reference(ctx)
    out = paged_decode_attention(q, cache, tables, ctx, None, head_dim**-0.5).view(len(lens), heads, -1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for row in range(len(lens)):
        assert _rel(out[row], ref[row]) < tol, (row, lens[row], _rel(out[row], ref[row]))
    # A kernel that lost the last 1/8 of a long context would be far outside that tolerance.
    short = ctx.clone()
    short[0] = lens[0] * 7 // 8
    assert _rel(reference(short)[0], ref[0]) > 20 * tol


@pytest.mark.parametrize("hidden", [896, 3584, 8192])
def test_fused_add_rms_norm_at_model_widths(hidden):
    from tidal.rollout.models.layers import RMSNorm

    gen = torch.Generator(device="cuda").manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.data = (torch.randn(hidden, device="cuda", generator=gen) * 0.5 + 1).to(torch.bfloat16)
    x, residual = (
        (torch.randn(1024, hidden, device="cuda", generator=gen) * 4).to(torch.bfloat16) for _ in "ab"
    )
    normed, total = norm(x, residual)
    total_ref = x.float() + residual.float()
    normed_ref = total_ref * torch.rsqrt(total_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
    assert torch.equal(total, (x + residual))  # the residual stream is the bf16 sum, exactly
    row_err = ((normed.float() - normed_ref).norm(dim=-1) / normed_ref.norm(dim=-1)).max().item()
    assert row_err < 8e-3, row_err  # bf16 output rounding is ~2e-3; a missing residual gives ~0.7
    assert _rel(norm._norm(x.float()) * norm.weight.float(), normed_ref) > 0.3
