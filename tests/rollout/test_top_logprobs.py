"""``SamplingParams.logprobs`` = k: each output token's k most likely alternatives, of the same distribution
(``log_softmax(logits / T)``) as the sampled token's log-prob, against one HF forward; rows that do not
ask get none and sample exactly as before."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.sampler import SamplingTensors, top_logprobs


@torch.inference_mode()
def _hf_distributions(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) over the vocabulary at each output position (T = 0: raw logits)."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return (logits / (temperature or 1.0)).log_softmax(-1)


def test_top_logprobs_are_sorted_and_follow_each_rows_temperature():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.0, 4.0, 1.0]])
    st = SamplingTensors(all_greedy=False, temperatures=torch.tensor([0.0, 2.0]))
    ids, values = top_logprobs(logits, st, 3)
    assert ids.tolist() == [[1, 2, 0], [2, 3, 0]]
    expected = torch.stack([logits[0].log_softmax(-1), (logits[1] / 2.0).log_softmax(-1)])
    torch.testing.assert_close(values, expected.gather(-1, ids))
    exact_ids, exact_values = top_logprobs(logits, st, 3, exact=True)
    assert exact_ids.tolist() == ids.tolist()
    torch.testing.assert_close(exact_values, values)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_alternatives_match_an_hf_forward(tiny_model, hf_model, temperature):
    path = tiny_model("llama")
    engine = LLMEngine(path, cpu_config(max_model_len=64, block_size=4))
    k = 4
    asked = SamplingParams(temperature=temperature, max_new_tokens=6, ignore_eos=True, seed=3, logprobs=k)
    plain = SamplingParams(temperature=temperature, max_new_tokens=6, ignore_eos=True, seed=3)
    # Mixed batch: rows that ask and rows that do not share every step.
    outs = engine.generate(PROMPTS[:2] + PROMPTS[:2], [asked, asked, plain, plain])
    for prompt, with_top, without in zip(PROMPTS[:2], outs[:2], outs[2:], strict=True):
        sample, reference = with_top.outputs[0], without.outputs[0]
        # Asking for alternatives changes nothing else.
        assert sample.token_ids == reference.token_ids and sample.logprobs == reference.logprobs
        assert reference.top_logprobs is None
        dist = _hf_distributions(hf_model(path), prompt, sample.token_ids, temperature)
        assert len(sample.top_logprobs) == len(sample.token_ids)
        for step, (token, logprob, top) in enumerate(
            zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True)
        ):
            assert len(top) == k
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            expected = dist[step].topk(k)
            assert [t for t, _ in top] == expected.indices.tolist()
            torch.testing.assert_close(torch.tensor(values), expected.values, atol=1e-5, rtol=0)
            if token in dict(top):
                assert dict(top)[token] == logprob  # the same number, not merely close
        if temperature == 0.0:  # greedy: the sampled token is the most likely one
            assert all(
                top[0] == (t, lp)
                for t, lp, top in zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True)
            )


def test_streaming_snapshots_carry_the_alternatives_so_far(tiny_model):
    engine = LLMEngine(tiny_model("llama"), cpu_config(max_model_len=64, block_size=4))
    request = engine.add_request(
        PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True, logprobs=2)
    )
    seen = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request
            sample = out.outputs[0]
            assert len(sample.top_logprobs) == len(sample.token_ids)
            seen.append(len(sample.token_ids))
    assert seen == [1, 2, 3]


def test_logprobs_must_not_be_negative():
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        SamplingParams(logprobs=-1)
    assert SamplingParams(logprobs=0).num_top_logprobs == 0


def test_chunked_prefill_and_exact_engines_give_the_same_alternatives(tiny_model):
    """The context-prefill step (chunked prompt) and the exact-log-prob sampler carry them too."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0.7, max_new_tokens=4, ignore_eos=True, seed=5, logprobs=3)
    plain = LLMEngine(path, cpu_config(max_model_len=64, block_size=4)).generate(PROMPTS, params)
    chunked_config = cpu_config(
        max_model_len=64, block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=8
    )
    chunked = LLMEngine(path, chunked_config).generate(PROMPTS, params)
    exact = LLMEngine(path, cpu_config(max_model_len=64, block_size=4, exact_logprobs=True)).generate(
        PROMPTS, params
    )
    for a, b, c in zip(plain, chunked, exact, strict=True):
        x, y, z = a.outputs[0], b.outputs[0], c.outputs[0]
        assert x.token_ids == y.token_ids == z.token_ids
        for tops in (y.top_logprobs, z.top_logprobs):
            for top_x, top_y in zip(x.top_logprobs, tops, strict=True):
                assert [t for t, _ in top_x] == [t for t, _ in top_y]
                torch.testing.assert_close(
                    torch.tensor([v for _, v in top_y]),
                    torch.tensor([v for _, v in top_x]),
                    atol=1e-5,
                    rtol=0,
                )
        for token, logprob, top in zip(z.token_ids, z.logprobs, z.top_logprobs, strict=True):
            if token in dict(top):
                assert dict(top)[token] == logprob


@pytest.mark.gpu
def test_cuda_engine_alternatives(tiny_model):
    """CUDA float32 (CUDA graphs, the fused Triton sampler for the sampled token): the alternatives come
    from the same distribution as the sampled log-prob and match an HF forward on the GPU."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="float32", max_model_len=64, block_size=4))
    k = 5
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=k)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=8, ignore_eos=True, seed=1, logprobs=k)
    plain = SamplingParams(temperature=0.8, max_new_tokens=8, ignore_eos=True, seed=1)
    outs = engine.generate(PROMPTS[:2] * 3, [greedy, greedy, sampled, sampled, plain, plain])
    for out in outs[4:]:
        assert out.outputs[0].top_logprobs is None
    for prompt, out, temperature in zip(PROMPTS[:2] * 2, outs[:4], [0.0, 0.0, 0.8, 0.8], strict=True):
        sample = out.outputs[0]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + sample.token_ids], device="cuda")).logits[
                0, len(prompt) - 1 : -1
            ]
            dist = (logits.float() / (temperature or 1.0)).log_softmax(-1).cpu()
        for step, (token, logprob, top) in enumerate(
            zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True)
        ):
            values = [v for _, v in top]
            assert len(top) == k and values == sorted(values, reverse=True)
            torch.testing.assert_close(torch.tensor(values), dist[step].topk(k).values, atol=1e-4, rtol=0)
            if temperature == 0.0:
                assert top[0][0] == token and abs(top[0][1] - logprob) < 1e-5
