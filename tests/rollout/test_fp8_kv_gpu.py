"""The FP8 KV cache's compiled Triton paths (skipped without a GPU) at realistic shapes, bf16 as served:
the decode kernel over long contexts and the prefill-with-context kernel against the torch paths reading
the same FP8 cache (a float32 reference over the dequantized values), the Triton stores bit-equal to the
torch store, and an engine whose Triton and torch backends generate the same tokens with an FP8 cache."""

from __future__ import annotations

import pytest
import torch

from tidal.rollout.runner import attention, kv_cache
from tidal.rollout.runner.attention import AttentionMetadata

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fp8_cache(gen, blocks, block, kv_heads, head_dim):
    full = torch.randn(2, blocks, block, kv_heads, head_dim, device="cuda", generator=gen)
    full[:, ::5] *= 50.0  # rows of very different sizes, as biased keys give: each row's scale matters
    q, scales = kv_cache.quantize_heads(full.to(torch.bfloat16).view(-1, kv_heads, head_dim))
    return q.view(full.shape), scales.view(full.shape[:-1]).contiguous()


@pytest.mark.parametrize("dtype, tiny, big", [(torch.bfloat16, 1e-6, 4e5), (torch.float16, 1e-3, 6e4)])
def test_decode_kernel_fp16_logits_keep_large_queries_and_tiny_values(dtype, tiny, big):
    """A bf16 or fp16 q takes its logits from fp16 dots (``paged_decode_attention``): a sequence whose
    queries reach ``big`` (their dots with the keys pass fp16's largest, 65504, without the softmax scale
    first) and one whose value rows are all ~``tiny`` (probability x value scale, ~1e-11 or ~1e-8, stays in
    bf16: fp16 would flush it to 0 or keep a few bits, as the kernel once did with an fp16 q) read as float32
    torch over the dequantized cache does, each row to 16-bit precision of its own size (fp16 outputs:
    value rows of 1e-3, whose outputs fp16 itself can hold). GPU only: Triton's interpreter multiplies the bit patterns of bf16
    operands in ``tl.dot``, so the CPU cannot check this path."""
    from tidal.rollout.kernels.triton_attention import paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(11)
    heads, kv_heads, head_dim, block = 28, 4, 128, 16
    lens = [700, 900, 33]
    width = max(lens) // block + 1
    full = torch.randn(2, len(lens) * width, block, kv_heads, head_dim, device="cuda", generator=gen)
    tables = torch.randperm(len(lens) * width, device="cuda", generator=gen).view(len(lens), width).int()
    full[1, tables[0].long()] *= tiny  # sequence 0: tiny values
    cache, scales = kv_cache.quantize_heads(full.to(dtype).view(-1, kv_heads, head_dim))
    cache, scales = cache.view(full.shape), scales.view(full.shape[:-1]).contiguous()
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), heads, head_dim, device="cuda", generator=gen)
    q[1] *= big / q[1].abs().amax()  # sequence 1: |q| up to big
    q = q.to(dtype)
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=None, kv_cache=cache[None], block_tables=tables, context_lens=ctx
    )
    ref = attention.torch_decode_attention(q.float(), cache, meta, None, head_dim**-0.5, scales)
    out = paged_decode_attention(q, cache, tables, ctx, None, head_dim**-0.5, kv_scales=scales)
    assert torch.isfinite(out).all()
    for row in range(len(lens)):
        assert _rel(out[row], ref[row]) < 1e-2, row


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(14, 2, 64), (28, 4, 128)])
@pytest.mark.parametrize("window", [None, 1000])
def test_decode_kernel_reads_the_fp8_cache_as_its_dequantized_values(heads, kv_heads, head_dim, window):
    """Contexts up to 16k in 16-token blocks scattered over the cache: the kernel (bf16 q, e4m3 cache, scales
    applied to logits and probabilities) against float32 torch over the dequantized cache."""
    from tidal.rollout.kernels.triton_attention import paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(heads)
    block, lens = 16, [16384, 17, 4096, 1, 9000, 300]
    width = max(lens) // block + 1
    cache, scales = _fp8_cache(gen, len(lens) * width, block, kv_heads, head_dim)
    tables = torch.randperm(len(lens) * width, device="cuda", generator=gen).view(len(lens), width).int()
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = (torch.randn(len(lens), heads, head_dim, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    meta = AttentionMetadata(
        is_prefill=False, slot_mapping=None, kv_cache=cache[None], block_tables=tables, context_lens=ctx
    )
    ref = attention.torch_decode_attention(q.float(), cache, meta, window, head_dim**-0.5, scales)
    out = paged_decode_attention(q, cache, tables, ctx, window, head_dim**-0.5, kv_scales=scales)
    for row in range(len(lens)):
        assert _rel(out[row], ref[row]) < 1e-2, (row, lens[row], _rel(out[row], ref[row]))
    # Reading the e4m3 values without their scales is far outside that tolerance.
    unscaled = paged_decode_attention(q, cache, tables, ctx, window, head_dim**-0.5, kv_scales=scales * 0 + 1)
    assert _rel(unscaled[0], ref[0]) > 0.1


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(14, 2, 64), (28, 4, 128)])
def test_fp8_stores_are_bit_equal_to_the_torch_store(heads, kv_heads, head_dim):
    """``rope_store_kv`` (the prefill's and Qwen3's store) and the fused RoPE + store + decode kernel write the
    bytes and scales that ``kv_cache.store`` writes for the same rotated keys and values, 256 rows."""
    from tidal.rollout.kernels.triton_attention import RopeInputs, paged_decode_attention
    from tidal.rollout.models.triton_fused import rope_store_kv

    gen = torch.Generator(device="cuda").manual_seed(7)
    batch, block, width = 256, 16, 8
    cache, scales = _fp8_cache(gen, batch * width + 1, block, kv_heads, head_dim)
    tables = torch.arange(batch * width, device="cuda").view(batch, width).int()
    ctx = torch.randint(1, width * block, (batch,), device="cuda", generator=gen).int()
    pos = (ctx - 1).long()
    slots = tables.long()[torch.arange(batch, device="cuda"), pos // block] * block + pos % block
    qkv = (torch.randn(batch, (heads + 2 * kv_heads) * head_dim, device="cuda", generator=gen) * 4).bfloat16()
    qkv[:, heads * head_dim : (heads + 1) * head_dim] += 200.0  # a biased key head
    angles = pos[:, None].float() * torch.rand(head_dim // 2, device="cuda", generator=gen)
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(batch, -1, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(batch, kv_heads, head_dim)

    stored = (cache.clone(), scales.clone())
    q, k = rope_store_kv(qk, v, cos, sin, heads, stored[0], slots, layer_scales=stored[1])
    by_torch = (cache.clone(), scales.clone())
    kv_cache.store(by_torch[0], by_torch[1], k, v, slots)
    assert torch.equal(stored[0].view(torch.uint8), by_torch[0].view(torch.uint8))
    assert torch.equal(stored[1], by_torch[1])
    fused = (cache.clone(), scales.clone())
    rope = RopeInputs(cos, sin, slots)
    out = paged_decode_attention(
        qkv.view(batch, -1, head_dim), fused[0], tables, ctx, None, 0.1, rope=rope, kv_scales=fused[1]
    )
    assert torch.equal(fused[0].view(torch.uint8), by_torch[0].view(torch.uint8))
    assert torch.equal(fused[1], by_torch[1])
    ref = paged_decode_attention(q, stored[0], tables, ctx, None, 0.1, kv_scales=stored[1])
    assert torch.equal(out, ref)


@pytest.mark.parametrize("window", [None, 1000])
def test_context_kernel_reads_the_fp8_cache_as_the_torch_path(window):
    """Prefix caching / chunked prefill over an FP8 cache: contexts 1k-16k, 1-512 new tokens a sequence."""
    from tests.rollout.test_triton_context import GPU_BATCH, make_case

    q, cache, meta = make_case(GPU_BATCH, 28, 4, 128, 16, torch.bfloat16, "cuda", seed=3)
    cache[:, ::5] *= 50.0
    quantized, scales = kv_cache.quantize_heads(cache.view(-1, *cache.shape[-2:]))
    fp8, scales = quantized.view(cache.shape), scales.view(cache.shape[:-1]).contiguous()
    meta.kv_cache, meta.backend = fp8[None], "triton"
    out = attention.context_prefill_attention(q, fp8, meta, window, 0.088, scales)
    ref = attention.torch_context_prefill_attention(q.float(), fp8, meta, window, 0.088, scales)
    assert _rel(out, ref) < 1e-2
    unscaled = attention.context_prefill_attention(q, fp8, meta, window, 0.088, scales * 0 + 1)
    assert _rel(unscaled, ref) > 0.1


# Heads of 32 (the tiny models' own) decode through the Triton kernel; heads of 64 through the CUDA kernel
# (kernels/cuda_fp8_decode.py), which covers heads of 64 and 128.
HEADS = {"heads32": {}, "heads64": dict(num_attention_heads=3, num_key_value_heads=1, head_dim=64)}


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_engine_triton_and_torch_backends_agree_with_an_fp8_cache(family, heads, tiny_model):
    """bf16 engine, FP8 cache, CUDA graphs: the GPU kernels (fused decode for qwen2 with heads of 32,
    rope_store_kv then decode otherwise) and the torch paths generate the same greedy tokens, with prefix
    caching (the second round reads its prompts' cached blocks through the context kernel)."""
    from tests.rollout.reference import PROMPTS, greedy
    from tidal.rollout import EngineConfig, LLMEngine

    path = tiny_model(family, **HEADS[heads])
    runs = {}
    for backend in ("triton", "torch"):
        config = EngineConfig(kv_cache_dtype="fp8", attention_backend=backend, enable_prefix_caching=True)
        engine = LLMEngine(path, config)
        assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        first = engine.generate(PROMPTS, greedy(24))
        second = engine.generate([p + [7, 8, 9] for p in PROMPTS], greedy(24))
        runs[backend] = [o.outputs[0] for o in first + second]
    for ours, ref in zip(runs["triton"], runs["torch"], strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=True)) if a != b), 24
        )
        assert same >= 12  # bf16 near-ties may part the two late; log-probs agree up to there
        torch.testing.assert_close(
            torch.tensor(ours.logprobs[:same]), torch.tensor(ref.logprobs[:same]), atol=0.05, rtol=0.05
        )
