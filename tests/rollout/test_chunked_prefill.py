"""Chunked prefill (``EngineConfig.enable_chunked_prefill``): prompts longer than
``max_num_batched_tokens`` are computed over several steps that alternate with decode steps, with the
same tokens and log-probs as a one-shot prefill."""

from __future__ import annotations

import pytest

from tests.rollout.reference import assert_same_outputs, greedy, small_cache_config
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [list(range(3 + i, 3 + i + 5 + 9 * i)) for i in range(5)]  # 5 to 41 tokens


@pytest.fixture(scope="module")
def qwen2(tiny_model):
    return tiny_model("qwen2")


def test_chunked_prefill_matches_one_shot(qwen2, monkeypatch):
    plain = LLMEngine(qwen2, small_cache_config())
    chunked = LLMEngine(qwen2, small_cache_config(enable_chunked_prefill=True, max_num_batched_tokens=7))
    computed = []
    forward = chunked.runner.model.forward
    monkeypatch.setattr(
        chunked.runner.model, "forward", lambda ids, *a: (computed.append(len(ids)), forward(ids, *a))[1]
    )
    assert_same_outputs(plain.generate(PROMPTS, greedy(5)), chunked.generate(PROMPTS, greedy(5)))
    assert max(computed) <= 7  # no step computes more than the budget (decode steps: <= 5 sequences)
    # Seeded sampling with n=3: the samples' copies of the last prompt block wait for the last chunk.
    sampled = SamplingParams(temperature=1.0, n=3, seed=3, max_new_tokens=5, ignore_eos=True)
    assert_same_outputs(plain.generate(PROMPTS, sampled), chunked.generate(PROMPTS, sampled))
    assert chunked.block_manager.num_free_blocks == chunked.num_kv_blocks


def test_chunks_alternate_with_decode_steps(qwen2):
    """A long prompt arriving while a sequence decodes: the decoding request advances every other step."""
    engine = LLMEngine(qwen2, small_cache_config(enable_chunked_prefill=True, max_num_batched_tokens=8))
    short = engine.add_request([5, 6, 7], greedy(30))
    engine.step()  # its prefill
    long = engine.add_request(list(range(10, 50)), greedy(2))  # 40 tokens: 5 chunks of 8
    advanced = [[out.request_id for out in engine.step()] for _ in range(11)]
    # decode, chunk 1 (nothing sampled), decode, ..., chunk 5 (the long prompt samples), both decode
    assert advanced == [[short], []] * 4 + [[short], [long], [short, long]]
    reference = LLMEngine(qwen2, small_cache_config())
    expected = reference.generate([[5, 6, 7], list(range(10, 50))], [greedy(30), greedy(2)])
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.outputs[0].token_ids == expected[out.request_id].outputs[0].token_ids


def test_abort_between_chunks_frees_the_blocks(qwen2):
    engine = LLMEngine(
        qwen2, small_cache_config(enable_chunked_prefill=True, max_num_batched_tokens=8, num_kv_blocks=20)
    )
    request = engine.add_request(list(range(10, 50)), greedy(2))
    assert engine.step() == []  # first chunk: nothing sampled yet
    assert engine.block_manager.num_free_blocks < 20
    assert engine.abort(request)
    assert engine.block_manager.num_free_blocks == 20 and not engine.scheduler.has_unfinished()


def test_chunked_prefill_with_prefix_caching(qwen2):
    engine = LLMEngine(
        qwen2,
        small_cache_config(enable_chunked_prefill=True, enable_prefix_caching=True, max_num_batched_tokens=6),
    )
    reference = LLMEngine(qwen2, small_cache_config())
    expected = reference.generate(PROMPTS, greedy(4))
    assert_same_outputs(expected, engine.generate(PROMPTS, greedy(4)))
    assert_same_outputs(expected, engine.generate(PROMPTS, greedy(4)))
    assert engine.scheduler.num_cached_tokens > 0


def test_refused_for_soft_capped_attention(tiny_model):
    """Gemma 2's soft-capped prefill attends to the step's own K/V only: a one-line refusal."""
    with pytest.raises(ValueError, match="enable_chunked_prefill is not supported with attention logit soft"):
        LLMEngine(tiny_model("gemma2"), small_cache_config(enable_chunked_prefill=True))


@pytest.mark.gpu
def test_cuda_context_prefill_matches(tiny_model):
    """On CUDA (CUDA-graph decode, Triton decode attention), float32: prefix caching + chunked prefill
    give the plain engine's tokens, log-probs within 1e-4."""
    path = tiny_model("qwen2")

    def config(**features):
        return EngineConfig(device="cuda", dtype="float32", max_model_len=128, block_size=4, **features)

    plain = LLMEngine(path, config())
    both = LLMEngine(
        path, config(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=7)
    )
    expected = plain.generate(PROMPTS, greedy(5))
    for _ in range(2):  # the second run hits the prefix cache
        got = both.generate(PROMPTS, greedy(5))
        for a, b in zip(expected, got, strict=True):
            x, y = a.outputs[0], b.outputs[0]
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
    assert both.scheduler.num_cached_tokens > 0
