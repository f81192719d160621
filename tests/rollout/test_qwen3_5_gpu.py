"""Qwen3.5 on CUDA (skipped without a GPU): flash-linear-attention's kernels against the torch gated delta
rule, and the hybrid engine on the GPU (fla's kernels when installed, and the torch path) against
transformers' log-probs on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config, hf_logprobs
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.models import gated_delta

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("length", [1, 37, 130])
def test_fla_kernels_match_the_torch_rule(length):
    if not gated_delta.fla_usable(torch.empty(0, device="cuda")):
        pytest.skip("flash-linear-attention is not installed")
    gen = torch.Generator(device="cuda").manual_seed(length)
    batch, k_heads, v_heads, k_dim, v_dim = 2, 2, 4, 64, 64

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = (
        rand(batch, length, k_heads, k_dim),
        rand(batch, length, k_heads, k_dim),
        rand(batch, length, v_heads, v_dim),
    )
    g = -torch.rand(batch, length, v_heads, generator=gen, device="cuda")
    beta = torch.rand(batch, length, v_heads, generator=gen, device="cuda")
    state = rand(batch, v_heads, k_dim, v_dim)
    want_out, want_state = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, state)
    for recurrent in (False, True):
        out, final = gated_delta.fla_gated_delta_rule(q, k, v, g, beta, state, recurrent=recurrent)
        torch.testing.assert_close(out, want_out, atol=2e-3, rtol=0)
        torch.testing.assert_close(final, want_state, atol=2e-3, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
@pytest.mark.parametrize("kernels", ["fla", "torch"])
def test_cuda_engine_logprobs_match_transformers(family, kernels, tiny_model, hf_model, monkeypatch):
    if kernels == "torch":
        monkeypatch.setattr(gated_delta, "fla_usable", lambda x: False)
    elif not gated_delta.fla_usable(torch.empty(0, device="cuda")):
        pytest.skip("flash-linear-attention is not installed")
    path = tiny_model(family, logit_scale=4.0)
    hf = hf_model(path)
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    config = EngineConfig(device="cuda", dtype="float32", max_model_len=128, block_size=4)
    engine = LLMEngine(path, config)
    assert engine.eager  # CUDA graphs are refused for the family: eager decode
    outputs = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        sample = out.outputs[0]
        expected = hf_logprobs(hf, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=2e-3, rtol=0)
    if kernels == "torch":  # float32 torch ops on the GPU: the CPU engine's greedy tokens
        cpu = LLMEngine(path, cpu_config(max_model_len=128, block_size=4))
        want = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, params)]
        assert [o.outputs[0].token_ids for o in outputs] == want
    # bfloat16 (the dtype of real runs) with n samples, chunked prefill and sleep/wake runs.
    bf16 = LLMEngine(path, EngineConfig(device="cuda", max_model_len=128, enable_chunked_prefill=True,
                                        max_num_batched_tokens=16))  # fmt: skip
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, n=4, seed=0, ignore_eos=True)
    first = bf16.generate(PROMPTS, sampled)
    bf16.sleep(level=2)
    bf16.wake_up()
    again = bf16.generate(PROMPTS, sampled)
    assert [[s.token_ids for s in o.outputs] for o in first] == [
        [s.token_ids for s in o.outputs] for o in again
    ]
