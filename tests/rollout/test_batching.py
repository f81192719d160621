"""Continuous batching, preemption, prompt sharing for n > 1 samples, and seeded reproducibility."""

from __future__ import annotations

import torch

from tests.rollout.reference import PROMPTS, cpu_config, hf_greedy, hf_logprobs
from tidal.rollout import LLMEngine, SamplingParams

# Mixed prompt lengths and output budgets, more requests than max_num_seqs.
REQUESTS = [(list(range(3 + i, 3 + i + 2 + 3 * i)), 4 + (7 * i) % 17) for i in range(10)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _alone(engine, prompt, max_new):
    return engine.generate([prompt], _greedy(max_new))[0].outputs[0].token_ids


def test_continuous_batching_matches_each_request_alone(tiny_model):
    path = tiny_model("qwen2")
    reference = LLMEngine(path, cpu_config(max_model_len=128, max_num_seqs=1, block_size=4))
    engine = LLMEngine(path, cpu_config(max_model_len=128, max_num_seqs=3, block_size=4))
    outputs = engine.generate([p for p, _ in REQUESTS], [_greedy(n) for _, n in REQUESTS])
    for (prompt, max_new), out in zip(REQUESTS, outputs, strict=True):
        sample = out.outputs[0]
        assert len(sample.token_ids) == max_new and sample.finish_reason == "length"
        assert sample.token_ids == _alone(reference, prompt, max_new)
    # Every block went back to the pool.
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_preemption_recomputes_to_the_same_output(tiny_model, monkeypatch):
    path = tiny_model("llama")
    reference = LLMEngine(path, cpu_config(max_model_len=64, max_num_seqs=1, block_size=4))
    # 10 blocks of 4 slots cannot hold 4 sequences of 9-12 + 20 tokens: some must be preempted.
    engine = LLMEngine(path, cpu_config(max_model_len=64, max_num_seqs=4, block_size=4, num_kv_blocks=10))
    preempted = []
    original = engine.scheduler._preempt
    monkeypatch.setattr(
        engine.scheduler, "_preempt", lambda seq: (preempted.append(seq.seq_id), original(seq))
    )
    prompts = [list(range(20 + i, 29 + i + i)) for i in range(4)]
    outputs = engine.generate(prompts, _greedy(20))
    assert preempted, "the test should exercise preemption"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == _alone(reference, prompt, 20)
    assert engine.block_manager.num_free_blocks == 10


def test_n_greedy_samples_share_one_prefill(tiny_model, hf_model, monkeypatch):
    path = tiny_model("qwen3")
    engine = LLMEngine(path, cpu_config(max_model_len=64, block_size=4))
    prompt = [*PROMPTS[2], 9]  # 21 tokens: 5 shared full blocks and a partial one copied per sample
    seen = []
    forward = engine.runner.model.forward
    monkeypatch.setattr(
        engine.runner.model, "forward", lambda ids, *a: (seen.append(len(ids)), forward(ids, *a))[1]
    )
    out = engine.generate([prompt], SamplingParams(temperature=0.0, n=3, max_new_tokens=10))[0]
    assert seen[0] == len(prompt), "the prompt is prefilled once, not once per sample"
    expected = hf_greedy(hf_model(path), prompt, 10)
    assert [s.index for s in out.outputs] == [0, 1, 2]
    assert all(s.token_ids == expected for s in out.outputs)


def test_n_samples_are_distinct_with_correct_logprobs(tiny_model, hf_model):
    path = tiny_model("llama")
    engine = LLMEngine(path, cpu_config(max_model_len=64, block_size=4))
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=12, seed=7, ignore_eos=True)
    samples = engine.generate([prompt], params)[0].outputs
    assert len({tuple(s.token_ids) for s in samples}) == 4
    for sample in samples:
        expected = hf_logprobs(hf_model(path), prompt, sample.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


def test_seed_reproduces_regardless_of_batch(tiny_model):
    path = tiny_model("mistral")
    params = SamplingParams(temperature=0.9, top_k=50, n=2, max_new_tokens=12, seed=1234)
    other = SamplingParams(temperature=1.0, max_new_tokens=7)

    def run(config, prompts, plist):
        return LLMEngine(path, config).generate(prompts, plist)

    alone = run(cpu_config(max_model_len=64), [PROMPTS[0]], [params])[0]
    crowded = run(
        cpu_config(max_model_len=64, max_num_seqs=3, block_size=4), PROMPTS, [other, other, params, other]
    )
    again = run(cpu_config(max_model_len=64), [PROMPTS[0]], [params])[0]
    tokens = [s.token_ids for s in alone.outputs]
    assert tokens == [s.token_ids for s in again.outputs]
    assert tokens[0] != tokens[1]
    crowded_alone = run(cpu_config(max_model_len=64), [PROMPTS[2]], [params])[0]
    assert [s.token_ids for s in crowded[2].outputs] == [s.token_ids for s in crowded_alone.outputs]
    reseeded = SamplingParams(temperature=0.9, top_k=50, n=2, max_new_tokens=12, seed=99)
    assert [
        s.token_ids for s in run(cpu_config(max_model_len=64), [PROMPTS[0]], [reseeded])[0].outputs
    ] != tokens


def test_engine_seed_reproduces_unseeded_requests(tiny_model):
    path = tiny_model("qwen2")
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=10)

    def run(seed):
        outs = LLMEngine(path, cpu_config(max_model_len=64, seed=seed)).generate(PROMPTS, params)
        return [[s.token_ids for s in o.outputs] for o in outs]

    assert run(3) == run(3)
    assert run(3) != run(4)
