"""The CUDA decode kernel over an FP8 KV cache (``kernels/fp8_decode.cu``; skipped without a GPU), at the
engine's shapes: against float32 torch over the dequantized cache and against the Triton kernel, for both
head sizes, several GQA groups, context splits, int32/int64 tables, fp16 and bf16, larger pages, padding
rows, never-written (NaN-patterned) slots past the context, and a CUDA-graph replay."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tidal.rollout.kernels import cuda_fp8_decode
from tidal.rollout.runner import attention, kv_cache
from tidal.rollout.runner.attention import AttentionMetadata

pytestmark = pytest.mark.gpu
ta = pytest.importorskip("tidal.rollout.kernels.triton_attention", reason="the GPU kernels need triton")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _case(seed, lens, heads, kv_heads, head_dim, block=16, dtype=torch.bfloat16, int64=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = max(lens) // block + 1
    blocks = len(lens) * width
    full = torch.randn(2, blocks, block, kv_heads, head_dim, device="cuda", generator=gen)
    full[:, ::5] *= 50.0  # rows of very different sizes: each row's scale matters
    full[1, 1::7] *= 1e-4
    cache, scales = kv_cache.quantize_heads(full.to(dtype).view(-1, kv_heads, head_dim))
    cache, scales = cache.view(full.shape), scales.view(full.shape[:-1]).contiguous()
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(len(lens), width)
    ctx = torch.tensor(lens, device="cuda")
    index = torch.int64 if int64 else torch.int32
    q = (torch.randn(len(lens), heads, head_dim, device="cuda", generator=gen) * 2).to(dtype)
    return q, cache, scales, tables.to(index), ctx.to(index)


def _reference(q, cache, scales, tables, ctx):
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=None, kv_cache=cache[None], block_tables=tables, context_lens=ctx
    )
    return attention.torch_decode_attention(q.float(), cache, meta, None, q.shape[-1] ** -0.5, scales)


@pytest.fixture(autouse=True)
def _cuda_kernel_for_split_contexts_too(monkeypatch):
    """The engine keeps split contexts on the Triton kernel (``FP8_CUDA_MAX_SPLITS``); tested here all the
    same, so that a change of that choice finds a tested kernel."""
    monkeypatch.setattr(ta, "FP8_CUDA_MAX_SPLITS", 16)


def _both_kernels(q, cache, scales, tables, ctx, num_splits=None):
    args = (q, cache, tables, ctx, None, q.shape[-1] ** -0.5, num_splits)
    assert cuda_fp8_decode.variant_for(q, q.shape[1], cache, tables, None, None) is not None
    cuda = ta.paged_decode_attention(*args, kv_scales=scales)
    ta.FP8_CUDA_KERNEL = False
    try:
        triton = ta.paged_decode_attention(*args, kv_scales=scales)
    finally:
        ta.FP8_CUDA_KERNEL = True
    return cuda, triton


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(28, 4, 128), (14, 2, 64), (32, 8, 128), (8, 1, 64), (4, 4, 128)]
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_kernel_reads_the_fp8_cache_as_its_dequantized_values(heads, kv_heads, head_dim, num_splits):
    """Ragged contexts (1 to 5,000 tokens, pages shuffled over the cache): each row within 1% of float32
    torch over the dequantized cache, as close as the Triton kernel is."""
    lens = [5000, 1, 17, 16, 384, 640, 129, 2048]
    q, cache, scales, tables, ctx = _case(heads + head_dim, lens, heads, kv_heads, head_dim)
    ref = _reference(q, cache, scales, tables, ctx)
    cuda, triton = _both_kernels(q, cache, scales, tables, ctx, num_splits)
    for row in range(len(lens)):
        assert _rel(cuda[row], ref[row]) < 1e-2, (row, _rel(cuda[row], ref[row]))
        assert _rel(cuda[row], ref[row]) < 2 * _rel(triton[row], ref[row]) + 2e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("int64", [False, True])
@pytest.mark.parametrize("block", [16, 32])
def test_cuda_kernel_dtypes_index_types_and_page_sizes(dtype, int64, block):
    lens = [700, 33, 1000, 48]
    q, cache, scales, tables, ctx = _case(5, lens, 28, 4, 128, block, dtype, int64)
    ref = _reference(q, cache, scales, tables, ctx)
    cuda, _ = _both_kernels(q, cache, scales, tables, ctx)
    assert cuda.dtype == dtype
    for row in range(len(lens)):
        assert _rel(cuda[row], ref[row]) < 1e-2, row


def test_slots_past_the_context_and_padding_rows_are_never_read():
    """Slots past each row's context hold e4m3 NaN bytes (0x7F) and their scales NaN, as memory never
    written may: the outputs stay those of a clean cache. A row of context 0 (a CUDA-graph padding row)
    returns zeros, with or without context splits."""
    lens = [40, 0, 16, 300]
    q, cache, scales, tables, ctx = _case(3, lens, 28, 4, 128)
    dirty, dirty_scales = cache.clone(), scales.clone()
    block = cache.shape[2]
    for row, n in enumerate(lens):
        for pos in range(n, tables.shape[1] * block):
            page, slot = int(tables[row, pos // block]), pos % block
            dirty.view(torch.uint8)[:, page, slot] = 0x7F
            dirty_scales[:, page, slot] = float("nan")
    for splits in (1, 4):
        args = (tables, ctx, None, 128**-0.5, splits)
        clean = ta.paged_decode_attention(q, cache, *args, kv_scales=scales)
        out = ta.paged_decode_attention(q, dirty, *args, kv_scales=dirty_scales)
        assert torch.equal(out, clean)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_cuda_kernel_in_a_cuda_graph_equals_eager():
    """Captured once, replayed after the contexts grow and the cache changes: eager's bits."""
    lens = [100, 300, 1, 900]
    q, cache, scales, tables, ctx = _case(9, lens, 28, 4, 128)  # tables hold 912 tokens a row
    static_ctx = ctx.clone()
    ta.paged_decode_attention(q, cache, tables, static_ctx, None, 0.1, kv_scales=scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ta.paged_decode_attention(q, cache, tables, static_ctx, None, 0.1, kv_scales=scales)
    static_ctx.add_(11)
    cache.view(torch.uint8)[:, :3] ^= 1
    graph.replay()
    eager = ta.paged_decode_attention(q, cache, tables, static_ctx, None, 0.1, kv_scales=scales)
    assert torch.equal(out, eager)


@contextlib.contextmanager
def _no_launch_before():
    """The calls inside must take the CUDA kernel's ROPE build: fails if ``rope_store_kv``'s launch runs
    before the kernel, or if no call reaches the kernel built with ``rope`` (the Triton kernel took them)."""
    original_store, original_decode, builds = ta.rope_then_store, cuda_fp8_decode.fp8_paged_decode, []

    def decode(variant, *args, **kwargs):
        builds.append(variant.rope)
        return original_decode(variant, *args, **kwargs)

    ta.rope_then_store = lambda *a, **k: pytest.fail("rope_store_kv ran: the ROPE build was not taken")
    cuda_fp8_decode.fp8_paged_decode = decode
    try:
        yield
    finally:
        ta.rope_then_store, cuda_fp8_decode.fp8_paged_decode = original_store, original_decode
    assert builds and all(builds), builds


def _rope_case(seed, lens, heads, kv_heads, head_dim, dtype, int64):
    """A packed projection [batch, heads + 2 kv_heads, d] of ``dtype``, cos/sin of each row's position and
    its cache slot (the last token of its context; a row of context 0, a padding row, writes its first page's
    first slot, which no row reads, as the engine's padding rows write a reserved slot), over ``_case``'s
    cache."""
    _, cache, scales, tables, ctx = _case(seed, lens, heads, kv_heads, head_dim, dtype=dtype, int64=int64)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    batch, block = len(lens), cache.shape[2]
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, device="cuda", generator=gen) * 3
    qkv[:, heads] += 100.0  # a biased key head: its scale matters
    pos = (ctx.long() - 1).clamp(min=0)
    slots = tables.long()[torch.arange(batch, device="cuda"), pos // block] * block + pos % block
    angles = pos[:, None].float() * torch.rand(head_dim // 2, device="cuda", generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    return qkv.to(dtype), cache, scales, tables, ctx, ta.RopeInputs(cos, sin, slots)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(28, 4, 128), (14, 2, 64), (8, 1, 128)])
@pytest.mark.parametrize("dtype, int64", [(torch.bfloat16, False), (torch.float16, True)])
def test_the_rope_build_stores_and_attends_as_rope_store_kv_then_the_kernel(
    heads, kv_heads, head_dim, dtype, int64
):
    """The ROPE build (the kernel rotates q and k and stores k and v itself) against ``rope_store_kv``'s launch
    followed by the plain build: the same cache bytes and scales, the same outputs, bit for bit. Contexts
    whose step's token lies in a warp's first copies (1-64 tokens) or later ones, and a padding row."""
    lens = [1, 0, 16, 17, 64, 65, 300, 1023]
    qkv, cache, scales, tables, ctx, rope = _rope_case(11, lens, heads, kv_heads, head_dim, dtype, int64)
    args = (tables, ctx, None, head_dim**-0.5, 1)
    fused = (cache.clone(), scales.clone())
    with _no_launch_before():
        out = ta.paged_decode_attention(qkv, fused[0], *args, rope=rope, kv_scales=fused[1])
    ta.FP8_CUDA_ROPE = False
    try:
        apart = (cache.clone(), scales.clone())
        ref = ta.paged_decode_attention(qkv, apart[0], *args, rope=rope, kv_scales=apart[1])
    finally:
        ta.FP8_CUDA_ROPE = True
    assert torch.equal(fused[0].view(torch.uint8), apart[0].view(torch.uint8))
    assert torch.equal(fused[1], apart[1])
    assert not torch.equal(fused[1], scales)  # the step's rows were stored
    assert torch.equal(out, ref)


def test_the_rope_build_in_a_cuda_graph_equals_eager():
    """Captured once, replayed with other projections, positions and slots: eager's cache and outputs."""
    lens = [100, 300, 0, 900]
    qkv, cache, scales, tables, ctx, rope = _rope_case(13, lens, 28, 4, 128, torch.bfloat16, False)
    graph_cache = (cache.clone(), scales.clone())
    args = (tables, ctx, None, 0.1, 1)
    ta.paged_decode_attention(qkv, graph_cache[0], *args, rope=rope, kv_scales=graph_cache[1])
    graph = torch.cuda.CUDAGraph()
    with _no_launch_before(), torch.cuda.graph(graph):
        out = ta.paged_decode_attention(qkv, graph_cache[0], *args, rope=rope, kv_scales=graph_cache[1])
    ctx.add_((ctx > 0).to(ctx.dtype))  # one step on: new positions and slots, new projections and angles
    pos, block = (ctx.long() - 1).clamp(min=0), cache.shape[2]
    rows = torch.arange(len(lens), device="cuda")
    rope.slot_mapping.copy_(tables.long()[rows, pos // block] * block + pos % block)
    qkv.copy_((torch.randn(qkv.shape, device="cuda") * 5).to(qkv.dtype))
    rope.cos.copy_(rope.sin)
    rope.sin.copy_(torch.rand(rope.sin.shape, device="cuda").to(rope.sin.dtype))
    eager_cache = (graph_cache[0].clone(), graph_cache[1].clone())
    graph.replay()
    eager = ta.paged_decode_attention(qkv, eager_cache[0], *args, rope=rope, kv_scales=eager_cache[1])
    assert torch.equal(out, eager)
    assert torch.equal(graph_cache[0].view(torch.uint8), eager_cache[0].view(torch.uint8))
    assert torch.equal(graph_cache[1], eager_cache[1])
