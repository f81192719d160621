"""Prefix caching on a hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention): recurrent states
saved at block boundaries (``state_cache.SavedStates``). Same tokens as without the cache and as
transformers, hand-computed hits (a repeated prompt, a shared prefix, a match ending mid-block, a second
turn), a state dropped with its evicted block never used, n samples, chunked prefill, preemption, async
scheduling asked for (and, on CUDA, decode under CUDA graphs)."""

from __future__ import annotations

import pytest

from tests.rollout.reference import assert_same_outputs, greedy, hf_greedy, small_cache_config
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.scheduling.prefix_cache import extend_block_hashes

FAMILY = "qwen3_5_text"
SYSTEM = list(range(40, 52))  # 12 tokens: 3 full blocks of 4
PROMPTS = [SYSTEM + [7], SYSTEM + [9, 8, 7, 6, 5, 4, 3], SYSTEM + [11, 12, 13, 14, 15, 16, 17, 18, 19]]
TOL = 1e-4  # log-probs: a context prefill sums in another order (the chunked rule's chunks shift)


@pytest.fixture(scope="module")
def path(tiny_model):
    return tiny_model(FAMILY, logit_scale=4.0)  # peaked logits: completions sensitive to every state


@pytest.fixture(scope="module")
def plain(path):
    return LLMEngine(path, small_cache_config(max_num_seqs=4))


def cached_engine(path, **overrides) -> LLMEngine:
    return LLMEngine(path, small_cache_config(enable_prefix_caching=True, max_num_seqs=4, **overrides))


def run_one(engine: LLMEngine, prompt: list[int], n: int = 8) -> tuple[list, int]:
    """Generate ``prompt`` alone; return the outputs and the prompt tokens taken from the cache."""
    before = engine.scheduler.num_cached_tokens
    out = engine.generate([prompt], greedy(n))
    return out, engine.scheduler.num_cached_tokens - before


def test_hits_are_hand_computed_and_outputs_equal_no_cache_and_transformers(path, plain, hf_model):
    engine = cached_engine(path)
    hf = hf_model(path)
    # A first prompt (13 tokens): prefilled [0, 12) then [12, 13), saving the state at 12. No hit.
    out, hit = run_one(engine, PROMPTS[0])
    assert hit == 0 and out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 8)
    assert_same_outputs(plain.generate([PROMPTS[0]], greedy(8)), out, TOL)
    # The same prompt again: its 3 full blocks before the last token, state saved at 12.
    assert run_one(engine, PROMPTS[0])[1] == 12
    # A shared prefix of 3 blocks (the system prompt), then 7 tokens of its own: 12 cached.
    out, hit = run_one(engine, PROMPTS[1])
    assert hit == 12 and out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[1], 8)
    assert_same_outputs(plain.generate([PROMPTS[1]], greedy(8)), out, TOL)
    # A match ending mid-block: PROMPTS[1]'s first 17 tokens and 2 others. The cached blocks hold 16 of
    # them, and PROMPTS[1] saved its state at 16 (its last boundary before its last token): 16 cached.
    mid = PROMPTS[1][:17] + [30, 31]
    out, hit = run_one(engine, mid)
    assert hit == 16 and out[0].outputs[0].token_ids == hf_greedy(hf, mid, 8)
    # A prefix shared in KV but not at a saved state: PROMPTS[2] shares blocks [0, 12) only: 12.
    assert run_one(engine, PROMPTS[2])[1] == 12
    # A second turn: the previous prompt + its answer + a new message. The answer's blocks were cached
    # when the sequence finished, but decode saves no state: it resumes at the first turn's last saved
    # state (20 for PROMPTS[2]'s 21 tokens) and recomputes the answer.
    first = engine.generate([PROMPTS[2]], greedy(6))[0].outputs[0].token_ids
    turn = PROMPTS[2] + first + [60, 61, 62]
    out, hit = run_one(engine, turn)
    assert hit == 20 and out[0].outputs[0].token_ids == hf_greedy(hf, turn, 8)
    assert_same_outputs(plain.generate([turn], greedy(8)), out, TOL)
    # Every block and slot given back; the saved states stay while their blocks are cached.
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    assert engine.block_manager.state_slots.num_free == 4 and len(engine.block_manager.saved_states) > 0
    # The saved state matters: a hit that resumed from whatever its slot held instead goes astray.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine.block_manager, "take_state_loads", lambda: [])
        out, hit = run_one(engine, turn)  # 30 tokens: resumes at its last boundary before its last, 28
    assert hit == 28 and out[0].outputs[0].token_ids != hf_greedy(hf, turn, 8)


def test_a_prefix_shared_by_two_prompts_saves_its_state_for_the_third(path, plain):
    """Prompts with a shared system prompt whose end no earlier prompt saved: the second one (KV hit,
    no state) recomputes and saves the state at the end of the shared blocks; the third resumes there."""
    engine = cached_engine(path)
    prompts = [SYSTEM + [200 + i, 201 + i, 202 + i, 203 + i, 204 + i, 205] for i in range(3)]  # 18 tokens
    hits = [run_one(engine, p)[1] for p in prompts]
    assert hits == [0, 0, 12]
    expected = plain.generate(prompts, greedy(8))
    assert_same_outputs(expected, engine.generate(prompts, greedy(8)), TOL)
    # Sleep frees the states with the KV cache and forgets every saved one: the next run starts afresh.
    engine.sleep()
    engine.wake_up()
    assert len(engine.block_manager.saved_states) == 0
    out, hit = run_one(engine, prompts[0])
    assert hit == 0
    assert_same_outputs(expected[:1], out, TOL)


def test_batch_n_samples_and_async_equal_no_cache(path, plain):
    """A batch run twice (the second hits), seeded n=3 sampling, and async scheduling asked for (the
    engine keeps prefix caching's steps synchronous, ``ahead.async_fallback``)."""
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_new_tokens=8, ignore_eos=True)
    expected, sampled = plain.generate(PROMPTS, greedy(8)), plain.generate(PROMPTS, params)
    for overrides in ({}, {"async_scheduling": True}):
        engine = cached_engine(path, **overrides)
        assert_same_outputs(expected, engine.generate(PROMPTS, greedy(8)), TOL)
        before = engine.scheduler.num_cached_tokens
        assert_same_outputs(expected, engine.generate(PROMPTS, greedy(8)), TOL)
        # Each prompt resumes at its own last boundary before its last token: 12, 16, 20.
        assert engine.scheduler.num_cached_tokens - before == 12 + 16 + 20
        assert_same_outputs(sampled, engine.generate(PROMPTS, params), TOL)
        assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_chunked_prefill_and_preemption_with_the_cache_on(path, plain):
    """Chunks of at most 7 tokens (a state saved wherever one ends on a block boundary), n = 2, then a
    KV cache of 16 blocks that preempts sequences (recomputed through the cache): the plain tokens."""
    two = SamplingParams(temperature=0.0, n=2, max_new_tokens=8, ignore_eos=True)
    expected = plain.generate(PROMPTS, two)
    chunked = cached_engine(path, enable_chunked_prefill=True, max_num_batched_tokens=7)
    for _ in range(2):  # the second run resumes at saved states
        assert_same_outputs(expected, chunked.generate(PROMPTS, two), TOL)
    assert chunked.scheduler.num_cached_tokens > 0
    prompts = [SYSTEM + [60 + i, 70 + i, 80 + i] for i in range(4)]  # 15 tokens + 14: 8 blocks each
    want = plain.generate(prompts, greedy(14))
    small = cached_engine(path, num_kv_blocks=16, max_model_len=64)
    preempted = []
    preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    assert_same_outputs(want, small.generate(prompts, greedy(14)), TOL)
    assert preempted and small.block_manager.num_free_blocks == 16


def test_a_state_dropped_with_its_evicted_block_is_never_used(path, plain, monkeypatch):
    """Under a KV cache of 12 blocks, another prompt evicts the first prompt's blocks and with them the
    state saved at their end; the first prompt again then loads no state and recomputes, correctly."""
    engine = cached_engine(path, num_kv_blocks=12, max_model_len=48)
    blocks = engine.block_manager
    loads = []
    take = blocks.take_state_loads

    def recorded() -> list[tuple[int, int]]:
        taken = take()
        loads.extend(taken)
        return taken

    monkeypatch.setattr(blocks, "take_state_loads", recorded)
    first = PROMPTS[1]  # 19 tokens: its state saved at 16, the end of its block 3
    want = plain.generate([first], greedy(8))
    assert_same_outputs(want, run_one(engine, first)[0], TOL)
    keys: list[int] = []
    extend_block_hashes(keys, first, 4, 4)
    assert keys[3] in blocks.saved_states and not loads
    # 30 + 8 tokens take 10 of the 12 blocks: the first prompt's blocks 2.. are evicted (the free queue
    # holds a freed sequence's tail first), and the state saved at block 3's end with them.
    other = [300 + i for i in range(30)]
    assert_same_outputs(plain.generate([other], greedy(8)), run_one(engine, other)[0], TOL)
    assert keys[3] not in blocks.saved_states and keys[3] not in blocks.prefix_cache.blocks
    # Its blocks 0 and 1 are still cached, but no state was saved at their end: nothing is resumed.
    out, hit = run_one(engine, first)
    assert hit == 0 and not loads
    assert_same_outputs(want, out, TOL)
    # That run saved the state at 16 again: the next one resumes there.
    out, hit = run_one(engine, first)
    assert hit == 16 and len(loads) == 1
    assert_same_outputs(want, out, TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_cuda_graphs_and_async_with_the_cache_on(tiny_model, family):
    """On CUDA in float32, decode under CUDA graphs and async scheduling asked for: the cached engine gives
    the plain (graphs + async) engine's greedy tokens, log-probs within 1e-4, twice (the second run
    resumes each prompt at its last block boundary before its last token), for n = 2 samples too."""
    path = tiny_model(family, logit_scale=4.0)
    system = [(7 * i) % 400 + 3 for i in range(48)]  # 3 blocks of 16
    prompts = [system + [(11 * i + k) % 400 + 3 for i in range(k)] for k in (5, 21, 40)]  # 53, 69, 88

    def engine(**features) -> LLMEngine:
        config = dict(device="cuda", dtype="float32", max_model_len=256, block_size=16, async_scheduling=True)
        return LLMEngine(path, EngineConfig(**config, **features))

    plain, cached = engine(), engine(enable_prefix_caching=True)
    assert cached.runner.graphs is not None and plain.async_scheduling
    two = SamplingParams(temperature=0.0, n=2, max_new_tokens=24, ignore_eos=True)
    expected = plain.generate(prompts, two)
    for hits in (0, 48 + 64 + 80):
        before = cached.scheduler.num_cached_tokens
        assert_same_outputs(expected, cached.generate(prompts, two), TOL)
        assert cached.scheduler.num_cached_tokens - before == hits
    assert cached.block_manager.num_free_blocks == cached.num_kv_blocks
