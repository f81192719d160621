"""Gemma 4 text on CUDA (gpu): the Triton paged kernels read the full-attention layers' cache (their rows
fill the cache's), the torch ops the sliding layers' strided views; CUDA graphs and async scheduling
replay both. float32 greedy tokens equal transformers' on the GPU; bfloat16 graphs, async steps, prefix
caching and chunked prefill agree with eager synchronous decode, also for the MoE layout."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, assert_same_start
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

FAMILY = "gemma4_text"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
LONG = PROMPTS[1:3]  # longer than the sliding window (8)


def _tokens(engine, prompts=LONG):
    return [out.outputs[0].token_ids for out in engine.generate(prompts, GREEDY)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("eager", "variant"),
    [(True, {}), (False, {}), (False, dict(global_head_dim=512))],
    ids=["eager", "graphs", "graphs-global512"],
)
def test_cuda_float32_matches_transformers(tiny_model, hf_model, eager, variant):
    """The third case has Gemma 4 E2B's 512-wide global heads (wider than the Triton kernels take)."""
    path = tiny_model(FAMILY, logit_scale=4.0, **variant)
    engine = LLMEngine(
        path,
        EngineConfig(device="cuda", dtype="float32", max_model_len=128, block_size=16, enforce_eager=eager),
    )
    assert engine.runner.backend == "triton" and engine.eager == eager
    hf = hf_model(path).cuda()
    try:
        for _ in range(2):  # the second run replays the captured graphs
            for prompt, out in zip(LONG, engine.generate(LONG, GREEDY), strict=True):
                with torch.inference_mode():
                    ref = hf.generate(
                        torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=12
                    )
                assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    finally:
        hf.cpu()


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, MOE], ids=["dense", "moe"])
def test_cuda_bfloat16_graphs_async_prefix_cache_and_chunks_agree_with_eager(tiny_model, variant):
    path = tiny_model(FAMILY, logit_scale=4.0, **variant)
    base = dict(device="cuda", dtype="bfloat16", max_model_len=128, block_size=16)
    prompts = [LONG[0] + [7, 8, 9], LONG[0] + [300, 301, 302, 303, 304, 305], LONG[1]]
    eager = LLMEngine(path, EngineConfig(enforce_eager=True, async_scheduling=False, **base))
    want = eager.generate(prompts, GREEDY)
    for extra in (
        dict(async_scheduling=True),
        dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16),
    ):
        engine = LLMEngine(path, EngineConfig(**base, **extra))
        assert not engine.eager
        for _ in range(2):
            assert_same_start(want, engine.generate(prompts, GREEDY))
