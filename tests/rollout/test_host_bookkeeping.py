"""The engine's per-step host bookkeeping kept incremental (issue #18): block tables rewritten only where
they changed, stop rules resolved once per sequence, sampling tensors reused across steady decode steps,
and a step planned ahead that takes no block when it cannot launch."""

from __future__ import annotations

import random

import numpy as np

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.runner.steps import BlockTables, fill_decode_inputs
from tidal.rollout.scheduling.block_manager import BlockManager
from tidal.rollout.scheduling.scheduler import ScheduledBatch, Scheduler
from tidal.rollout.scheduling.sequence import Sequence


def test_block_tables_kept_between_steps_stage_what_the_lists_hold():
    """Tables that grow, shrink, are replaced by ones of the same length (a preempted sequence, a block
    given back and another taken), and sequences that leave or change rows: each step's staged inputs
    equal those written from the lists alone. As ``BlockManager`` does, a table grows in place and
    changes otherwise by a new list."""
    rng = random.Random(0)
    seqs = [Sequence(i, i, 0, [7] * (1 + i), SamplingParams(), 0) for i in range(6)]
    for seq in seqs:
        seq.block_table = [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
    tables = BlockTables(max_rows=8, max_blocks=6)
    for _ in range(200):
        seq = rng.choice(seqs)
        change = rng.randrange(4)
        if change == 0 and len(seq.block_table) < 6:
            seq.block_table.append(rng.randrange(50))
        elif change == 1 and len(seq.block_table) > 1:
            seq.block_table = seq.block_table[:-1]  # ``BlockManager.return_block``
            seq.block_table.append(rng.randrange(50))  # same length, another last block
        elif change == 2:
            seq.block_table = [rng.randrange(50) for _ in seq.block_table]  # same length, all new
        elif len(seq.block_table) > 1:
            seq.block_table = seq.block_table[:-1]  # shorter
        batch = rng.sample(seqs, rng.randrange(1, len(seqs) + 1))
        rows = rng.randrange(len(batch), 9)
        width = max(len(s.block_table) for s in batch)
        ahead = None if rng.random() < 0.5 else (list(range(len(batch))), len(batch))
        want = fill_decode_inputs(batch, rows, width, np.full(128, -1, np.int32), ahead)
        kept, longest = tables.update(batch, rows)
        assert longest == width
        got = fill_decode_inputs(batch, rows, width, np.full(128, -1, np.int32), ahead, kept)
        assert got.tolist() == want.tolist()


def _old_stop_rule(seq: Sequence, eos: set[int], max_model_len: int) -> tuple[str, object] | None:
    """The stop rule as it was written before it was resolved per sequence (stop strings aside)."""
    params, token = seq.params, seq.token_ids[-1]
    num_output = len(seq.token_ids) - seq.num_prompt_tokens
    if num_output >= params.min_new_tokens:
        if token in eos and not params.ignore_eos:
            return ("stop", token)
        if token in params.stop_token_ids:
            return ("stop", token)
    if num_output >= params.max_new_tokens or len(seq.token_ids) >= max_model_len:
        return ("length", None)
    return None


def test_stop_rules_resolved_per_sequence_match_the_rule():
    rng = random.Random(1)
    eos, max_model_len = {3, 4}, 24
    scheduler = Scheduler(BlockManager(64, 4), 8, 64, max_model_len, eos)
    for i in range(300):
        max_new = rng.randrange(1, 30)
        params = SamplingParams(
            max_new_tokens=max_new,
            min_new_tokens=min(max_new, rng.choice([0, 0, 2, 5])),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(8), rng.randrange(3)),
        )
        seq = Sequence(i, i, 0, [9] * rng.randrange(1, 12), params, 0)
        scheduler.add([seq])
        while not seq.is_finished:
            seq.append(rng.randrange(8), 0.0)
            want = _old_stop_rule(seq, eos, max_model_len)
            assert scheduler._check_stop(seq) == (want is not None)
            assert (seq.finish_reason, seq.stop_reason) == (want or (None, None))
            # What ``plan_ahead`` assumes: a sequence one token before its length limit ends on any token.
            assert (seq.num_tokens + 1 >= seq.max_num_tokens) == (
                seq.num_output_tokens + 1 >= params.max_new_tokens or seq.num_tokens + 1 >= max_model_len
            )


def test_decode_batch_keeps_its_sequences():
    seqs = [Sequence(i, i, 0, [5, 6], SamplingParams(), 0) for i in range(3)]
    batch = ScheduledBatch.decode(seqs)
    assert batch.seqs is seqs and batch.groups == [[s] for s in seqs] and not batch.is_prefill
    chunked = ScheduledBatch(True, [seqs[:2], seqs[2:]], chunks=[(0, 2), (0, 1)], final=[True, False])
    assert chunked.seqs == seqs[:2]


def _counting_builds(engine: LLMEngine) -> list[int]:
    """Each time ``engine`` builds sampling tensors from Python: the ``ahead`` it was built for."""
    builds = []
    build = engine.runner._build_sampling_tensors
    engine.runner._build_sampling_tensors = lambda seqs, ahead=0: (builds.append(ahead), build(seqs, ahead))[
        1
    ]
    return builds


def test_sampling_tensors_are_reused_in_the_steady_state(tiny_model):
    """Async scheduling: the per-row sampling settings are rebuilt while a row is under ``min_new_tokens``
    (its position counts toward it), then reused (positions advanced on the device) while the batch does
    not change; the tokens are those of the synchronous loop."""
    path = tiny_model("qwen2")
    params = SamplingParams(
        n=4, temperature=1.0, max_new_tokens=24, min_new_tokens=6, ignore_eos=True, seed=0
    )
    outputs = {}
    for wanted in (False, True):
        engine = LLMEngine(path, cpu_config(max_model_len=64, block_size=4, async_scheduling=wanted))
        engine.ahead_policy.max_miss_rate = 1.0
        builds = _counting_builds(engine)
        outputs[wanted] = engine.generate(PROMPTS[:2], params)
    assert engine.ahead_stats.used == engine.ahead_stats.launched > 0
    # The prefill and the first decode step (launched synchronously), then the steps launched ahead
    # (``ahead`` 1) at positions 2-5, under min_new_tokens; the 18 steps after reuse the last build.
    assert builds == [0, 0, 1, 1, 1, 1]
    for want, got in zip(outputs[False], outputs[True], strict=True):
        for a, b in zip(want.outputs, got.outputs, strict=True):
            assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)


def test_a_step_not_planned_ahead_keeps_no_block():
    """``plan_ahead`` walks the batch once: a repetition penalty or a full pool found after it took
    blocks for earlier sequences gives them back (the free queue as before), and plans nothing."""
    manager = BlockManager(num_blocks=3, block_size=4)
    scheduler = Scheduler(manager, 8, 64, 64, {2})
    plain, penalized = (
        SamplingParams(max_new_tokens=8),
        SamplingParams(max_new_tokens=8, repetition_penalty=1.2),
    )
    seqs = [Sequence(i, i, 0, [5, 6, 7, 8], p, 0) for i, p in enumerate((plain, plain, penalized))]
    for seq in seqs:
        scheduler._resolve_stop_rules(seq)  # as ``add`` does (without queueing: nothing waits)
    manager.allocate(seqs[:1])
    manager.allocate(seqs[1:2])
    before = list(manager.free_blocks)
    assert scheduler.plan_ahead(ScheduledBatch.decode(seqs[:2])) is None  # one free block for two
    assert list(manager.free_blocks) == before and [len(s.block_table) for s in seqs[:2]] == [1, 1]
    manager.free(seqs[1])
    manager.allocate(seqs[2:])  # one block left
    before = list(manager.free_blocks)
    assert scheduler.plan_ahead(ScheduledBatch.decode([seqs[0], seqs[2]])) is None  # the penalty
    assert list(manager.free_blocks) == before and len(seqs[0].block_table) == 1
    plan = scheduler.plan_ahead(ScheduledBatch.decode(seqs[:1]))
    assert plan.seqs == seqs[:1] and plan.rows == [0] and plan.blocks == [(seqs[0], seqs[0].block_table[-1])]
