"""The CUDA path (skipped without a GPU): float32 parity with HF on the GPU, and a bf16 smoke run."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cuda_float32_greedy_matches_hf(family, tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model(family)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="float32", max_model_len=128, block_size=4))
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=16)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_cuda_bfloat16_sampling_sleep_and_wake(tiny_model):
    engine = LLMEngine(tiny_model("qwen2"), EngineConfig(device="cuda", max_model_len=128))
    assert engine.dtype == torch.bfloat16
    params = SamplingParams(temperature=1.0, top_p=0.9, n=4, max_new_tokens=16, seed=0, ignore_eos=True)
    first = engine.generate(PROMPTS, params)
    engine.sleep(level=2)
    engine.wake_up()
    second = engine.generate(PROMPTS, params)
    for a, b in zip(first, second, strict=True):
        for sa, sb in zip(a.outputs, b.outputs, strict=True):
            assert len(sa.token_ids) == 16 and all(lp <= 0 for lp in sa.logprobs)
            assert sa.token_ids == sb.token_ids
