"""The paged Triton kernels with gpt-oss's attention sinks (``sinks=``) against the torch sink path
(``sink_attention.torch_sink_attention``: SDPA with the sink as an extra key), on CUDA: decode with and
without context splits (the sink joins after the merge), sliding windows and padding rows, and prefill
with context. Skipped without a GPU (Triton is not installed on the CPU test machines)."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.test_triton_context import make_case
from tidal.rollout.kernels.sink_attention import torch_sink_attention
from tidal.rollout.runner.attention import AttentionMetadata, context_kernel_attention

pytestmark = pytest.mark.gpu


def _close(out, ref, dtype, what):
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0, msg=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, window, splits",
    [(8, 2, 64, None, 1), (8, 2, 64, 7, 4), (4, 4, 32, None, 2), (16, 2, 64, 30, None)],
)
def test_decode_kernel_with_sinks_matches_torch(dtype, heads, kv_heads, head_dim, window, splits):
    from tidal.rollout.kernels.triton_attention import paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(heads + (splits or 0))
    batch, blocks, block_size, width = 6, 64, 16, 12
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    tables = torch.stack([torch.randperm(blocks, device="cuda", generator=gen)[:width] for _ in range(batch)])
    tables = tables.to(torch.int32)
    ctx = torch.tensor([width * block_size, 1, 0, 17, 40, 3], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads + kv_heads, head_dim, device="cuda", generator=gen).to(dtype)[:, :heads]
    sinks = (torch.randn(heads, device="cuda", generator=gen) * 3).to(dtype)
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=None,
        kv_cache=cache[None].float(),
        block_tables=tables,
        context_lens=ctx,
    )
    scale = head_dim**-0.5
    ref = torch_sink_attention(q.float(), cache.float(), meta, window, scale, sinks.float())
    out = paged_decode_attention(q, cache, tables, ctx, window, scale, num_splits=splits, sinks=sinks)
    live = ctx > 0
    _close(out[live], ref[live], dtype, "decode with sinks")
    assert (out[~live] == 0).all()  # a padding row reads nothing
    plain = paged_decode_attention(q, cache, tables, ctx, window, scale, num_splits=splits)
    assert (plain[live].float() - ref[live]).abs().max() > 0.05  # the sinks matter at these values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, splits", [(None, 1), (None, 2), (9, 1), (9, 4)])
def test_context_kernel_with_sinks_matches_torch(dtype, window, splits):
    chunks = [(0, 37), (40, 41), (100, 164), (5, 12)]  # (start, end) of each sequence's queries
    q, layer_cache, meta = make_case(chunks, 8, 2, 64, 16, dtype, "cuda", seed=3)
    sinks = (torch.randn(8, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).cuda()
    meta.kv_cache = layer_cache[None].float()
    ref = torch_sink_attention(q.float(), layer_cache.float(), meta, window, 0.125, sinks.float())
    out = context_kernel_attention(q, layer_cache, meta, window, 0.125, num_splits=splits, sinks=sinks)
    _close(out, ref, dtype, "prefill with context and sinks")


def test_engine_triton_backend_matches_torch_backend(tiny_model, tmp_path):
    """The tiny gpt-oss with large sinks on CUDA float32: the Triton kernels (decode, chunked prefill over
    a cached prefix) give the torch backend's tokens and log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.rollout.reference import PROMPTS
    from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model("gpt_oss")), dtype=torch.float32)  # a copy
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-3.0, 3.0, layer.self_attn.sinks.numel()))
    hf.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model("gpt_oss")).save_pretrained(tmp_path)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[1] + [7, 8, 9], PROMPTS[2]]
    runs = {}
    for backend in ("torch", "triton"):
        config = EngineConfig(
            device="cuda", dtype="float32", max_model_len=128, block_size=4, attention_backend=backend,
            enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16,
        )  # fmt: skip
        engine = LLMEngine(tmp_path, config)
        runs[backend] = [engine.generate(prompts, params) for _ in range(2)]  # the second hits the cache
    for torch_run, triton_run in zip(runs["torch"], runs["triton"], strict=True):
        for a, b in zip(torch_run, triton_run, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            diff = max(abs(x - y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True))
            assert diff < 1e-4
