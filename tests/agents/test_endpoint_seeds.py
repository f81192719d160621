"""``--agent_endpoint`` episodes sample reproducibly: in a seeded rollout an agent's request without a
``seed`` samples with ``sequence_seed(<episode seed>, k)`` (k: its number in the episode), so the
tokens and rewards do not depend on the order in which concurrent episodes reach the server."""

from __future__ import annotations

import asyncio
import contextlib
import zlib

import pytest

from tidal.agents.endpoint import EndpointAgentExecutor, EpisodeSeeds
from tidal.rollout import SamplingParams
from tidal.rollout.runner.sampler import sequence_seed

N_PROMPTS, N_SAMPLES, TURNS, ROLLOUT_SEED = 3, 2, 2, 5
SLOTS = [(i, j) for i in range(N_PROMPTS) for j in range(N_SAMPLES)]


class Schedule:
    """Lets the episodes' requests reach the server one at a time, in a fixed order of (slot, k) keys."""

    def __init__(self, order: list[tuple]):
        self.order, self.done = order, set()
        self.cond = asyncio.Condition()  # binds to the executor's event loop on first use

    def _next(self):
        return next((key for key in self.order if key not in self.done), None)

    @contextlib.asynccontextmanager
    async def turn(self, key):
        async with self.cond:
            await self.cond.wait_for(lambda: self._next() == key)
        try:
            yield
        finally:
            await self.release([key])

    async def release(self, keys) -> None:
        async with self.cond:
            self.done.update(keys)
            self.cond.notify_all()


def make_agent(schedule: Schedule, texts: dict, recorded, own_seed: int | None = None):
    """An agent that sends NO seed (unless ``own_seed``, on its first request): TURNS completions per
    episode, each waiting for its turn in ``schedule``; a later prompt is the token ids so far plus one.

    ``recorded(episode id)``: the episode's recorded requests. The OpenAI API returns no token ids, and a
    random tiny model's text does not re-tokenize to the sampled ids, so the agent reads them there."""
    import httpx

    samples_seen: dict[str, int] = {}

    async def agent(base_url, prompt, label):
        # the n samples of a prompt start in sample order (asyncio.gather), before any of them awaits
        samples_seen[label] = samples_seen.get(label, -1) + 1
        slot = (int(label), samples_seen[label])
        episode = base_url.split("/episodes/")[1].split("/")[0]
        answers, next_prompt = [], prompt
        try:
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                for k in range(TURNS):
                    body = {"model": "policy", "prompt": next_prompt, "max_tokens": 4}
                    if own_seed is not None and k == 0:
                        body["seed"] = own_seed
                    async with schedule.turn((slot, k)):
                        reply = await client.post("completions", json=body)
                    answers.append(reply.json()["choices"][0]["text"])
                    last = recorded(episode)[-1]
                    next_prompt = [*last.prompt_token_ids, *last.samples[0].token_ids, 7]  # 7: an observation
        finally:  # whatever happens, the other episodes' turns still come
            await schedule.release([(slot, k) for k in range(TURNS)])
        texts[slot] = answers
        return float(zlib.crc32("|".join(answers).encode()) % 7)

    return agent


def run_episodes(engine, tokenizer, order: list[tuple], own_seed: int | None = None):
    texts: dict = {}
    executor = EndpointAgentExecutor(None)
    executor.func = make_agent(
        Schedule(order), texts, lambda episode: executor._recorder.episode(episode), own_seed
    )
    params = SamplingParams(n=N_SAMPLES, temperature=1.0, max_new_tokens=4, seed=ROLLOUT_SEED)
    prompts = [f"{i} + {i} =" for i in range(N_PROMPTS)]
    trajectories = executor.run(engine, tokenizer, prompts, [str(i) for i in range(N_PROMPTS)], params, 64)
    return trajectories, texts


def by_turn(slots: list[tuple]) -> list[tuple]:
    """Every episode's first request in ``slots`` order, then every second one, ..."""
    return [(slot, k) for k in range(TURNS) for slot in slots]


def first_action_is_seeded(engine, trajectory, seed: int) -> bool:
    """Whether the trajectory's first action is what the engine samples for its prompt with ``seed``."""
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=seed)
    expected = (
        engine.generate([trajectory.token_ids[: trajectory.prompt_len]], params)[0].outputs[0].token_ids
    )
    return list(trajectory.response_ids[: len(expected)]) == list(expected)


def test_episodes_sample_the_same_whatever_order_they_reach_the_server(engine, tokenizer):
    forward, forward_texts = run_episodes(engine, tokenizer, by_turn(SLOTS))
    backward, backward_texts = run_episodes(engine, tokenizer, by_turn(SLOTS[::-1]))
    assert forward_texts == backward_texts and len(forward_texts) == len(SLOTS)
    assert [t.token_ids for t in forward] == [t.token_ids for t in backward]
    assert [t.action_mask for t in forward] == [t.action_mask for t in backward]
    assert [t.reward for t in forward] == [t.reward for t in backward]
    assert all(t.error is None and t.num_turns == TURNS for t in forward)
    # the seed is the built-in multi-turn agent's: turn k of sample index i*n+j of the rollout
    for index, trajectory in enumerate(forward):
        assert first_action_is_seeded(
            engine, trajectory, sequence_seed(sequence_seed(ROLLOUT_SEED, index), 0)
        )
    # distinct episodes draw distinct noise (all would repeat one answer with a shared seed)
    assert len({tuple(t.response_ids) for t in forward}) > 1


def test_a_request_with_its_own_seed_keeps_it(engine, tokenizer):
    trajectories, _ = run_episodes(engine, tokenizer, by_turn(SLOTS), own_seed=1234)
    assert all(first_action_is_seeded(engine, t, 1234) for t in trajectories)


def test_episode_seeds_count_every_request_of_an_open_seeded_episode():
    seeds = EpisodeSeeds()
    seeds.open("a", 9)
    seeds.open("unseeded", None)  # an unseeded rollout: requests keep the engine's seeds
    assert [seeds.next_seed("a") for _ in range(3)] == [sequence_seed(9, k) for k in range(3)]
    assert seeds.next_seed("unseeded") is None and seeds.next_seed("unknown") is None
    assert seeds.next_seed(None) is None  # a request that names no episode
    seeds.close("a")
    assert seeds.next_seed("a") is None


@pytest.mark.parametrize("slots", [SLOTS, SLOTS[::-1]], ids=["forward", "backward"])
def test_schedule_orders_the_requests(slots):
    """The test's own device: requests reach the server in exactly the scheduled order."""
    schedule, seen = Schedule(by_turn(slots)), []

    async def episode(slot):
        for k in range(TURNS):
            async with schedule.turn((slot, k)):
                seen.append((slot, k))
                await asyncio.sleep(0)

    async def main():
        await asyncio.gather(*(episode(slot) for slot in SLOTS))

    asyncio.run(main())
    assert seen == by_turn(slots)
