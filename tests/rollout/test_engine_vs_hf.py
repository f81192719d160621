"""The engine against ``transformers``: greedy tokens and per-token log-probs, per family and RoPE variant."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import FAMILIES, PROMPTS, cpu_config, hf_greedy, hf_logprobs
from tidal.rollout import LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def _check_against_hf(engine, hf, prompts, params=GREEDY):
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        sample = out.outputs[0]
        assert sample.token_ids == hf_greedy(hf, prompt, params.max_new_tokens)
        assert len(sample.logprobs) == len(sample.token_ids)
        expected = hf_logprobs(hf, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_batch_matches_hf_generate(family, tiny_model, hf_model):
    path = tiny_model(family)
    # A small block size makes prompts span several KV blocks, some partially filled.
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4, max_num_seqs=8))
    _check_against_hf(engine, hf_model(path), PROMPTS)


def test_sampled_logprobs_are_log_softmax_of_tempered_logits(tiny_model, hf_model):
    path = tiny_model("qwen2")
    hf = hf_model(path)
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=8))
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16, n=2, seed=11, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:2], engine.generate(PROMPTS[:2], params), strict=True):
        for sample in out.outputs:
            assert len(sample.token_ids) == 16 and sample.finish_reason == "length"
            expected = hf_logprobs(hf, prompt, sample.token_ids, temperature=0.7)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


ROPE_CASES = {
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_matches_hf(case, tiny_model, hf_model):
    path = tiny_model("llama", **ROPE_CASES[case])
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=8))
    _check_against_hf(
        engine, hf_model(path), PROMPTS[1:3], SamplingParams(temperature=0.0, max_new_tokens=12)
    )


def test_sliding_window_matches_hf(tiny_model, hf_model):
    # Prompt and output both longer than the window, so the window actually masks keys.
    path = tiny_model("mistral", sliding_window=8)
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4))
    _check_against_hf(
        engine, hf_model(path), PROMPTS[1:3], SamplingParams(temperature=0.0, max_new_tokens=12)
    )
