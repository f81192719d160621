"""Prefix caching (``EngineConfig.enable_prefix_caching``): same tokens and log-probs as without it,
shared blocks (only uncached tokens are computed), multi-turn reuse, LRU eviction, invalidation."""

from __future__ import annotations

import random

import pytest

from tests.rollout.reference import assert_same_outputs, greedy, small_cache_config
from tidal.rollout import LLMEngine, SamplingParams

rng = random.Random(0)
SYSTEM = [rng.randrange(3, 500) for _ in range(37)]  # a "system prompt" over 9 full blocks of 4
PROMPTS = [SYSTEM + [rng.randrange(3, 500) for _ in range(k)] for k in (1, 6, 13, 22, 3)]


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def test_prefix_caching_matches_no_cache(llama):
    """A mixed-length batch sharing a system prompt, run twice (the second run hits the cache), then
    seeded sampling with n=2 (shared blocks plus copy-on-write of the last prompt block)."""
    plain, cached = (
        LLMEngine(llama, small_cache_config()),
        LLMEngine(llama, small_cache_config(enable_prefix_caching=True)),
    )
    expected = plain.generate(PROMPTS, greedy(6))
    assert_same_outputs(expected, cached.generate(PROMPTS, greedy(6)))
    before = cached.scheduler.num_prefill_tokens
    assert_same_outputs(expected, cached.generate(PROMPTS, greedy(6)))
    # Second run: every prompt's full blocks but the last token's are cached.
    assert cached.scheduler.num_prefill_tokens - before == sum(
        len(p) - (len(p) - 1) // 4 * 4 for p in PROMPTS
    )
    sampled = SamplingParams(temperature=1.0, n=2, seed=7, max_new_tokens=6, ignore_eos=True)
    assert_same_outputs(plain.generate(PROMPTS, sampled), cached.generate(PROMPTS, sampled))
    assert cached.block_manager.num_free_blocks == cached.num_kv_blocks


def test_second_request_computes_only_uncached_tokens(llama, monkeypatch):
    engine = LLMEngine(llama, small_cache_config(enable_prefix_caching=True))
    computed = []
    forward = engine.runner.model.forward
    monkeypatch.setattr(
        engine.runner.model, "forward", lambda ids, *a: (computed.append(len(ids)), forward(ids, *a))[1]
    )
    first = engine.generate([PROMPTS[1]], greedy(1))  # 43 tokens: 10 full blocks computed
    assert computed == [43]
    computed.clear()
    longer = PROMPTS[1] + [5, 6, 7, 8, 9]  # 48 tokens: the 40 cached ones are reused, 8 computed
    second = engine.generate([longer], greedy(3))
    assert computed[0] == 8 and engine.scheduler.num_cached_tokens == 40
    reference = LLMEngine(llama, small_cache_config())
    assert_same_outputs(reference.generate([PROMPTS[1]], greedy(1)), first)
    assert_same_outputs(reference.generate([longer], greedy(3)), second)


def test_multi_turn_history_reuses_decoded_blocks(llama):
    """Turn 2's prompt is turn 1's prompt + answer + a new message: the blocks filled while decoding
    the answer are cached when the sequence ends, so only the new message is computed."""
    engine = LLMEngine(llama, small_cache_config(enable_prefix_caching=True))
    reference = LLMEngine(llama, small_cache_config())
    history = list(PROMPTS[0])  # 38 tokens
    for turn in range(3):
        out = engine.generate([history], greedy(10))
        assert_same_outputs(reference.generate([history], greedy(10)), out)
        before = engine.scheduler.num_prefill_tokens
        history = history + out[0].outputs[0].token_ids + [11 + turn, 12, 13]
        if turn == 2:
            break
        engine.generate([history], greedy(1))
        # Cached: the previous turn's sequence but its last (sampled, never computed) token, in full blocks.
        cached = (len(history) - 3 - 1) // 4 * 4
        assert engine.scheduler.num_prefill_tokens - before == len(history) - cached


def test_lru_eviction_under_a_tiny_cache(llama):
    engine = LLMEngine(llama, small_cache_config(enable_prefix_caching=True, num_kv_blocks=12))
    reference = LLMEngine(llama, small_cache_config())
    a, b = PROMPTS[0][:20], list(range(100, 140))
    engine.generate([a], greedy(1))  # blocks 0-5; the 5 full ones (0-4) stay cached once freed
    assert len(engine.block_manager.prefix_cache) == 5
    # b takes 10 of the 12 blocks: the 6 never used first, then a's, tail first (5, then 4, 3, 2 evicted).
    assert_same_outputs(reference.generate([b], greedy(1)), engine.generate([b], greedy(1)))
    assert len(engine.block_manager.prefix_cache) == 2 + 10  # a's blocks 0-1 and all of b's
    before = engine.scheduler.num_prefill_tokens
    assert_same_outputs(reference.generate([a], greedy(2)), engine.generate([a], greedy(2)))
    assert engine.scheduler.num_prefill_tokens - before == 20 - 8  # a's first two blocks survived
    assert engine.block_manager.num_free_blocks == 12


def test_update_weights_and_sleep_invalidate_the_cache(llama, tiny_model, hf_model):
    other = tiny_model("llama", seed=1)
    engine = LLMEngine(llama, small_cache_config(enable_prefix_caching=True))
    engine.generate([PROMPTS[2]], greedy(2))
    engine.update_weights(hf_model(other).named_parameters())
    before = engine.scheduler.num_prefill_tokens
    out = engine.generate([PROMPTS[2]], greedy(4))
    assert engine.scheduler.num_prefill_tokens - before == len(PROMPTS[2])  # nothing reused
    assert_same_outputs(LLMEngine(other, small_cache_config()).generate([PROMPTS[2]], greedy(4)), out)
    engine.sleep()
    engine.wake_up()
    before = engine.scheduler.num_prefill_tokens
    assert_same_outputs(out, engine.generate([PROMPTS[2]], greedy(4)))
    assert engine.scheduler.num_prefill_tokens - before == len(PROMPTS[2])


@pytest.mark.parametrize("feature", ["enable_prefix_caching", "enable_chunked_prefill"])
@pytest.mark.parametrize("other", [{"record_routing": True}, {"tp_size": 2}])
def test_refused_with_router_replay_and_tensor_parallelism(feature, other):
    with pytest.raises(ValueError, match="need tp_size 1 and record_routing"):
        small_cache_config(**{feature: True}, **other)


def test_enable_prefix_caching_flag_reaches_the_engine():
    """``tidal ppo`` (RolloutConfig) and ``tidal generate`` (PolicyConfig) pass the OpenRLHF flag on."""
    from tidal.cli.generate import build_parser
    from tidal.config.engine import rollout_engine_config
    from tidal.config.rl import RolloutConfig
    from tidal.inference.config import PolicyConfig

    assert rollout_engine_config(RolloutConfig(enable_prefix_caching=True), "cpu", 0).enable_prefix_caching
    assert PolicyConfig(pretrain="m", enable_prefix_caching=True).engine_config(0).enable_prefix_caching
    assert not PolicyConfig(pretrain="m").engine_config(0).enable_prefix_caching
    argv = ["--pretrain", "m", "--dataset", "d.jsonl", "--output_path", "o.jsonl", "--enable_prefix_caching"]
    assert build_parser().parse_args(argv).enable_prefix_caching


def test_a_request_in_flight_across_update_weights_is_never_cached(llama, tiny_model, hf_model):
    """Its blocks hold K/V of the old weights (and, after the update, of the new ones): none may be
    cached when it ends, or a later prompt would reuse stale K/V."""
    engine = LLMEngine(llama, small_cache_config(enable_prefix_caching=True))
    engine.add_request(PROMPTS[3], greedy(6))
    engine.step()  # its prefill: the prompt's full blocks are cached at once
    assert len(engine.block_manager.prefix_cache) == len(PROMPTS[3]) // 4
    engine.update_weights(hf_model(tiny_model("llama", seed=1)).named_parameters())
    while engine.has_unfinished():
        engine.step()
    assert len(engine.block_manager.prefix_cache) == 0
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_multi_turn_agent_episodes_reuse_their_history(llama):
    """MultiTurnAgentExecutor, unchanged, submits each turn's whole history as token ids: with prefix
    caching the earlier turns' blocks are reused and the trajectories equal the cache-off ones."""
    from transformers import AutoTokenizer

    from tidal.agents import AgentInstanceBase, MultiTurnAgentExecutor

    class ThreeTurns(AgentInstanceBase):
        def __init__(self):
            self.turn = 0

        async def step(self, states, **kwargs):
            self.turn += 1
            feedback = " try again, and explain each step of the sum in more detail please:"
            return {"rewards": 0.0, "scores": 0.0, "environment_feedback": feedback, "done": self.turn == 3}

    tokenizer = AutoTokenizer.from_pretrained(str(llama))
    params = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        engine = LLMEngine(llama, small_cache_config(enable_prefix_caching=caching, max_model_len=256))
        trajectories = MultiTurnAgentExecutor(ThreeTurns).run(
            engine, tokenizer, ["What is 12+34? Think step by step."] * 2, ["46"] * 2, params, max_length=250
        )
        runs[caching] = ([t.token_ids for t in trajectories], [t.rollout_logprobs for t in trajectories])
        cached = engine.scheduler.num_cached_tokens
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    # Turns 2 and 3 of both episodes reuse at least the full blocks of the first turn's prompt.
    prompt_len = len(tokenizer("What is 12+34? Think step by step.")["input_ids"])
    assert cached >= 2 * 2 * (prompt_len // 4 * 4) > 0
