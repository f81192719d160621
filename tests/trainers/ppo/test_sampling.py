"""Rollout batches (trainers/ppo/sampling.py): dynamic filtering refills the batch as OpenRLHF does,
over-sampling feeds later steps, and a batch's position lets a resume train every prompt once."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from tidal.data.prompts import PromptSample
from tidal.experience.experience import Experience
from tidal.trainers.ppo.sampling import BatchPosition, RolloutBatcher, SamplingConfig, SamplingState
from tidal.trainers.ppo.stream import rollout_stream

N = 2  # samples per prompt


def prompts(count: int) -> list[PromptSample]:
    return [PromptSample(prompt=f"p{i}", label=str(i)) for i in range(count)]


class FakeRollout:
    """Scores by prompt: a prompt whose index is in ``solved`` scores 1 on both samples (filtered with the
    default range), any other 0 and 1. Each sample's token is its prompt's index, so a batch names its
    prompts; ``calls`` records the prompt indices of every generation round."""

    def __init__(self, solved: set[int] = frozenset()):
        self.solved, self.calls = solved, []

    def __call__(self, job):
        ids = [int(p.label) for p in job.prompts]
        self.calls.append(ids)
        rows = len(ids) * N
        seq = torch.tensor([[i, i] for i in ids for _ in range(N)])
        scores = torch.tensor([1.0 if i in self.solved else float(k) for i in ids for k in range(N)])
        exp = Experience(
            sequences=seq, attention_mask=torch.ones(rows, 2, dtype=torch.long),
            action_mask=torch.ones(rows, 2, dtype=torch.long), rollout_logprobs=torch.full((rows, 2), job.seed * 1.0),
            rewards=scores.clone(), scores=scores,
        )  # fmt: skip
        return exp, {"reward_logs/x": float(len(ids))}


def batcher(rollout, batch, generate, count, filtering=False):
    cfg = SamplingConfig(batch, generate, N, 1.0, (0.0, 1.0) if filtering else None)
    return RolloutBatcher(cfg, prompts(count), rollout, seed_of=lambda r: 100 + r)


def trained(result) -> list[int]:
    ids = result.exp.sequences[::N, 0].tolist()
    assert ids == result.prompt_ids  # the batch's rows are the prompts it names
    return ids


def test_without_filtering_batches_follow_the_order():
    rollout = FakeRollout()
    results = list(batcher(rollout, 3, 3, 10).batches(0, list(range(9)), BatchPosition(0, 0), 5))
    assert [trained(r) for r in results] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert rollout.calls == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [r.position for r in results] == [
        BatchPosition(0, 3, (), 6),
        BatchPosition(0, 6, (), 7),
        BatchPosition(0, 9, (), 8),
    ]
    assert results[0].stats == {}


def test_dynamic_filtering_draws_one_prompt_per_filtered_group():
    """OpenRLHF: a filtered group is replaced by the next prompt until the batch is full."""
    rollout = FakeRollout(solved={1, 3, 4})
    results = list(
        batcher(rollout, 3, 3, 12, filtering=True).batches(0, list(range(12)), BatchPosition(0, 0), 0)
    )
    # round 1: 0 1 2 (1 filtered) -> one more prompt: 3 (filtered) -> 4 (filtered) -> 5
    assert rollout.calls[:4] == [[0, 1, 2], [3], [4], [5]]
    assert [trained(r) for r in results] == [[0, 2, 5], [6, 7, 8], [9, 10, 11]]
    first = results[0].stats
    assert first["dynamic_filter/filtered"] == 3 and first["dynamic_filter/refilled"] == 3
    assert first["dynamic_filter/pass_rate"] == 50.0  # 3 accepted of 6 drawn
    assert results[1].stats["dynamic_filter/filtered"] == 0
    # the reward logs are the rounds' averaged by prompts: (3*3 + 1 + 1 + 1) / 6
    assert results[0].reward_logs == {"reward_logs/x": 2.0}


def test_dynamic_filtering_leaves_an_unfilled_batch_at_the_episode_end():
    rollout = FakeRollout(solved={4, 5})
    results = list(
        batcher(rollout, 3, 3, 7, filtering=True).batches(0, list(range(7)), BatchPosition(0, 0), 0)
    )
    assert [trained(r) for r in results] == [[0, 1, 2]]  # 3 6 accepted, 4 5 filtered: the prompts ran out
    assert rollout.calls == [[0, 1, 2], [3, 4, 5], [6]]


def test_over_sampling_feeds_the_next_steps_and_trains_each_prompt_once():
    rollout = FakeRollout()
    results = list(batcher(rollout, 2, 6, 12).batches(0, list(range(12)), BatchPosition(0, 0), 0))
    assert rollout.calls == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]  # one call per three steps
    ids = [trained(r) for r in results]
    assert ids == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert results[0].position == BatchPosition(0, 6, (2, 3, 4, 5), 1)
    assert sorted(sum(ids, [])) == list(range(12))


def test_over_sampling_with_filtering_fills_the_batch_from_the_extra_groups():
    rollout = FakeRollout(solved={0, 7})
    results = list(
        batcher(rollout, 2, 4, 12, filtering=True).batches(0, list(range(12)), BatchPosition(0, 0), 0)
    )
    assert rollout.calls == [[0, 1, 2, 3], [4], [5, 6, 7, 8], [9], [10, 11]]
    assert [trained(r) for r in results] == [[1, 2], [3, 4], [5, 6], [8, 9], [10, 11]]


@pytest.mark.parametrize("solved", [set(), {5, 9, 4}])
def test_a_resume_from_any_batch_trains_the_same_samples(solved):
    """The position of batch k (drawn count, buffered groups, next round) continues exactly where batch k
    ended: the same prompts and the same samples (each sample's log-probs are its round's seed here)."""
    order = [5, 3, 11, 0, 9, 1, 7, 2, 10, 4, 8, 6]
    whole = list(
        batcher(FakeRollout(solved), 2, 6, 12, bool(solved)).batches(0, order, BatchPosition(0, 0), 0)
    )
    assert len(whole) == (6 if not solved else 4)
    for k, result in enumerate(whole):
        state = SamplingState()
        state.load_state_dict(
            pickle.loads(pickle.dumps(result.position.state_dict()))
        )  # as torch.save keeps it
        rollout = FakeRollout(solved)
        rest = list(batcher(rollout, 2, 6, 12, bool(solved)).batches(0, order, state.start(0, 0), 77))
        assert [trained(r) for r in rest] == [trained(r) for r in whole[k + 1 :]]
        for a, b in zip(rest, whole[k + 1 :], strict=True):
            assert torch.equal(a.exp.rollout_logprobs, b.exp.rollout_logprobs)
        assert sum(map(len, rollout.calls)) == 12 - result.position.drawn  # nothing generated twice


def test_sampling_state_of_another_episode_or_an_older_checkpoint():
    state = SamplingState()
    state.load_state_dict({})  # a checkpoint written before the position was recorded
    assert state.start(2, 8) == BatchPosition(2, 8)
    state.load_state_dict({"episode": 1, "drawn": 4, "pending": [], "rounds": 3, "groups": []})
    assert state.start(1, 0) == BatchPosition(1, 4, (), 3) and state.start(2, 0) == BatchPosition(2, 0)


def test_async_stream_runs_the_batches_on_a_thread_ahead():
    threads = []

    def make(job):
        threads.append(threading.current_thread().name)
        return FakeRollout()(job)

    results = batcher(make, 2, 2, 8).batches(0, list(range(8)), BatchPosition(0, 0), 0)
    got = [trained(r) for r in rollout_stream(results, ahead=2)]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert set(threads) == {"tidal-rollout"}


def test_staleness_counts_the_steps_since_a_batchs_weights():
    """Over-sampling G = 3B: the three batches of one call were generated before the first was trained."""
    b = batcher(FakeRollout(), 2, 6, 12)
    lags = []
    for result in b.batches(0, list(range(12)), BatchPosition(0, 0), 0):
        lags.append(b.staleness(result))
        b.trained_one()
    assert [x["async/staleness_max"] for x in lags] == [0, 1, 2, 0, 1, 2]
    assert [x["async/stale_token_share"] for x in lags] == [0, 1, 1, 0, 1, 1]
    plain = batcher(FakeRollout(), 2, 2, 6)
    for result in plain.batches(0, list(range(6)), BatchPosition(0, 0), 0):
        assert plain.staleness(result) == {
            "async/staleness_mean": 0.0, "async/staleness_max": 0.0, "async/stale_token_share": 0.0
        }  # fmt: skip
        plain.trained_one()


@pytest.mark.parametrize("bound", [0, 1])
def test_max_staleness_holds_the_generation_thread(bound):
    """With a queue of 3 rollouts ahead, a round starts only when its batch will train at most ``bound``
    steps after the weights it is generated with (whatever the threads' timing)."""
    cfg = SamplingConfig(2, 2, N, 1.0, max_staleness=bound)
    started = []

    def make(job):
        started.append((job.index, b.trained))  # round i fills batch i (G = B)
        return FakeRollout()(job)

    b = RolloutBatcher(cfg, prompts(12), make, seed_of=lambda r: r)
    for result in rollout_stream(b.batches(0, list(range(12)), BatchPosition(0, 0), 0), ahead=3):
        assert b.staleness(result)["async/staleness_max"] <= bound
        b.trained_one()
    assert len(started) == 6 and all(index - trained <= bound for index, trained in started)
