"""LLMClient: concurrent per-sample requests become one engine call, with the right result each."""

from __future__ import annotations

import asyncio

import pytest

from tidal.agents import LLMClient
from tidal.rollout import SamplingParams

PROMPTS = [[1, 5, 6, 7], [1, 40, 41], [1, 100, 101, 102, 103, 104], [1, 9]]


def params(seed: int, max_new: int = 6) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed, ignore_eos=True)


async def _gather(client, prompts, delays=None):
    async def one(i, ids):
        for _ in range(delays[i] if delays else 0):  # coroutines reaching generate at different rounds
            await asyncio.sleep(0)
        return await client.generate(ids, params(seed=i))

    return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))


@pytest.mark.parametrize("delays", [None, [0, 1, 2, 0]])
def test_concurrent_requests_make_one_engine_call(spy, engine, delays):
    client = LLMClient(spy)
    results = asyncio.run(_gather(client, PROMPTS, delays))
    assert len(spy.calls) == 1 and client.batch_sizes == [4]
    assert sorted(spy.calls[0][0]) == sorted(PROMPTS)  # queue order follows arrival, not submission
    # Seeded sampling does not depend on the batch: each result equals a request of its own.
    for i, (ids, result) in enumerate(zip(PROMPTS, results, strict=True)):
        alone = engine.generate([ids], params(seed=i))[0].outputs[0]
        assert result.token_ids == alone.token_ids
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_sequential_requests_make_separate_calls(spy):
    async def main(client):
        first = await client.generate(PROMPTS[0], params(0))
        second = await client.generate(PROMPTS[1], params(1))
        return first, second

    client = LLMClient(spy)
    first, second = asyncio.run(main(client))
    assert client.batch_sizes == [1, 1] and len(first.token_ids) == 6 and len(second.token_ids) == 6


def test_engine_error_reaches_every_waiting_request(engine):
    class Broken:
        tokenizer = None

        def generate(self, prompts, sampling_params):
            raise RuntimeError("engine fell over")

    async def main():
        client = LLMClient(Broken())
        return await asyncio.gather(
            *(client.generate(ids, params(0)) for ids in PROMPTS), return_exceptions=True
        )

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "fell over" in str(r) for r in results)


def test_n_above_one_is_refused(engine):
    with pytest.raises(ValueError, match="n=2"):
        asyncio.run(LLMClient(engine).generate([1, 2], SamplingParams(n=2)))
