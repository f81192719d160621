"""``LLMEngine``'s step-level API (what ``tidal serve``'s engine loop drives) against ``generate``."""

from __future__ import annotations

import pytest

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(
        tiny_llama, EngineConfig(max_num_seqs=8, num_kv_blocks=64, block_size=8, max_model_len=96)
    )


def _drain(engine) -> dict[int, object]:
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finished
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_requests_added_between_steps_match_generate(engine):
    params = [
        SamplingParams(n=2, max_new_tokens=9, seed=1),
        SamplingParams(max_new_tokens=5, seed=2, stop=["e"]),
    ]
    prompts = [[5, 6, 7, 8], "the carry"]
    want = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    first = engine.add_request(prompts[0], params[0])
    engine.step()  # the second request joins a batch already decoding
    engine.step()
    second = engine.add_request(prompts[1], params[1])
    got = _drain(engine)
    for request_id, expected in zip((first, second), want, strict=True):
        out = got[request_id]
        assert out.prompt_token_ids == expected.prompt_token_ids
        for a, b in zip(out.outputs, expected.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_streaming_snapshots_grow_until_finished(engine):
    request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, seed=0))
    lengths = []
    while engine.has_unfinished():
        (out,) = engine.step()
        assert out.request_id == request_id
        lengths.append(len(out.outputs[0].token_ids))
        assert (out.outputs[0].finish_reason is None) == (not out.finished)
    assert lengths == [1, 2, 3, 4]


def test_snapshot_choice_keeps_final_outputs_and_skips_the_others(engine):
    """``step(snapshot=...)``: unfinished requests it declines get no output (nothing copied), chosen ones
    one per step, and every request still gets its final output, equal to the all-snapshots run."""
    params = [SamplingParams(max_new_tokens=n, seed=n) for n in (3, 5)]
    ids = [engine.add_request([5, 6, 7 + i], p) for i, p in enumerate(params)]
    reference = _drain(engine)
    ids = [engine.add_request([5, 6, 7 + i], p) for i, p in enumerate(params)]
    streamed, seen, final = ids[1], [], {}
    while engine.has_unfinished():
        for out in engine.step(snapshot=lambda r: r == streamed):
            seen.append((out.request_id, out.finished))
            if out.finished:
                final[out.request_id] = out
    assert [f for r, f in seen if r == ids[0]] == [True]  # the final output only
    assert [f for r, f in seen if r == streamed] == [False] * 4 + [True]
    for old, new in zip(sorted(reference), ids, strict=True):
        a, b = reference[old].outputs[0], final[new].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.logprobs) == (
            b.token_ids,
            b.text,
            b.finish_reason,
            b.logprobs,
        )


def test_abort_frees_blocks_and_generate_refuses_while_in_flight(engine):
    free = engine.block_manager.num_free_blocks
    kept = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, seed=3))
    dropped = engine.add_request([9, 10, 11, 12], SamplingParams(n=3, max_new_tokens=6, seed=3))
    engine.step()
    with pytest.raises(RuntimeError, match="step-level requests are in flight"):
        engine.generate([[5, 6]])
    assert engine.abort(dropped) and not engine.abort(dropped)
    got = _drain(engine)
    assert list(got) == [kept]
    assert engine.block_manager.num_free_blocks == free


def test_refused_request_queues_nothing(engine):
    with pytest.raises(ValueError, match="max_model_len is 96"):
        engine.add_request(list(range(5, 101)))
    assert not engine.has_unfinished()
