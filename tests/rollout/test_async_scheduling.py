"""Async scheduling (``EngineConfig.async_scheduling``): the same tokens, log-probs and finish reasons as the
synchronous loop, bit for bit, through ``generate`` and the step-level API, with requests stopping at
different steps, preemption, aborts and weight updates between steps; and the fallback rule."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.engine.ahead import AheadPolicy, async_fallback
from tidal.rollout.runner.cuda_graph import ahead_input_ids
from tidal.rollout.runner.steps import DecodeStep, fill_decode_inputs
from tidal.rollout.scheduling.block_manager import BlockManager
from tidal.rollout.scheduling.sequence import Sequence


def _pair(path, **overrides) -> tuple[LLMEngine, LLMEngine]:
    """A synchronous and an async engine, otherwise alike; the async one launches every step it can
    ahead (``AheadPolicy`` is tested on its own)."""
    config = {"max_model_len": 96, "block_size": 4, **overrides}
    lookahead = LLMEngine(path, cpu_config(async_scheduling=True, **config))
    lookahead.ahead_policy.max_miss_rate = 1.0
    return LLMEngine(path, cpu_config(**config)), lookahead


def _fields(out) -> list:
    """Everything a request output says, compared exactly (log-probs as floats, no tolerance)."""
    return [
        (s.index, s.token_ids, s.logprobs, s.finish_reason, s.stop_reason, s.text, s.top_logprobs)
        for s in out.outputs
    ] + [out.request_id, out.finished]


def _assert_same(expected, got) -> None:
    assert [_fields(o) for o in expected] == [_fields(o) for o in got]


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """The tiny llama with eos set to a token its greedy output produces early (so eos ends requests)."""
    path = tiny_model("llama")
    greedy = LLMEngine(path, cpu_config(max_model_len=96)).generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    eos = greedy[0].outputs[0].token_ids[9]
    copy = shutil.copytree(path, tmp_path_factory.mktemp("async") / "eos_model")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((copy / name).read_text())
        config["eos_token_id"] = eos
        (copy / name).write_text(json.dumps(config))
    return copy


def _mixed_params(stop: str) -> list[SamplingParams]:
    """Greedy and sampled requests ending at different steps: eos, stop ids, a stop string, max tokens,
    max_model_len, n > 1, min_new_tokens and top log-probs."""
    return [
        SamplingParams(temperature=0.0, max_new_tokens=30),  # eos
        SamplingParams(temperature=1.0, max_new_tokens=17, seed=1, stop_token_ids=[40, 41, 42, 43, 44]),
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=25, seed=2, stop=[stop], n=3),
        SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, max_new_tokens=90, seed=4, min_new_tokens=5, ignore_eos=True),
    ]


def test_generate_matches_the_synchronous_loop(eos_model):
    sync, lookahead = _pair(eos_model)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], list(range(5, 65))]
    params = _mixed_params(stop="e")
    want = sync.generate(prompts, params)
    got = lookahead.generate(prompts, params)
    _assert_same(want, got)
    reasons = {(s.finish_reason, type(s.stop_reason).__name__) for o in want for s in o.outputs}
    assert {("stop", "int"), ("stop", "str"), ("length", "NoneType")} <= reasons
    stats = lookahead.ahead_stats
    assert 0 < stats.used < stats.launched, "steps ran ahead; those after a stop were discarded"
    assert lookahead.block_manager.num_free_blocks == lookahead.num_kv_blocks
    # The engine is reusable: a second call starts from a clean state.
    _assert_same(sync.generate(prompts[:2], params[:2]), lookahead.generate(prompts[:2], params[:2]))


def test_tensor_parallel_engine_launches_ahead(eos_model):
    """TP=2 (two CPU processes over gloo): rank 0 sends the steps it launches ahead and the other rank takes
    their input ids from rank 0's by a broadcast; the outputs equal the synchronous TP=2 engine's."""
    engine = LLMEngine(
        eos_model, cpu_config(max_model_len=96, block_size=4, tp_size=2, async_scheduling=True)
    )
    engine.ahead_policy.max_miss_rate = 1.0
    try:
        assert engine.async_scheduling  # tensor parallelism is no longer a reason to stay synchronous
        prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], list(range(5, 65))]
        params = _mixed_params(stop="e")
        engine.async_scheduling = False  # one engine (and one worker process) for both loops
        want = engine.generate(prompts, params)
        engine.async_scheduling = True
        _assert_same(want, engine.generate(prompts, params))
        stats = engine.ahead_stats
        assert 0 < stats.used < stats.launched, "steps ran ahead; those after a stop were discarded"
    finally:
        engine.close()


def test_preemption_under_a_tiny_cache_matches(tiny_model, monkeypatch):
    sync, lookahead = _pair(tiny_model("qwen2"), max_num_seqs=4, num_kv_blocks=12)
    preempted = []
    original = lookahead.scheduler._preempt
    monkeypatch.setattr(
        lookahead.scheduler, "_preempt", lambda seq: (preempted.append(seq.seq_id), original(seq))
    )
    prompts = [list(range(20 + i, 29 + 2 * i)) for i in range(5)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=14 + 3 * i, seed=i, ignore_eos=True) for i in range(5)
    ]
    _assert_same(sync.generate(prompts, params), lookahead.generate(prompts, params))
    assert preempted, "the test should exercise preemption"
    assert lookahead.ahead_stats.used > 0
    assert lookahead.block_manager.num_free_blocks == 12


def _drive(engine, script) -> list[list]:
    """Run the same calls on an engine: add requests, step, abort, update weights; every step's outputs."""
    log, ids = [], []
    for action, arg in script:
        if action == "add":
            ids.append(engine.add_request(*arg))
        elif action == "abort":
            log.append(engine.abort(ids[arg]))
        elif action == "weights":
            engine.update_weights(arg)
        else:
            for _ in range(arg):
                log.append([_fields(o) for o in engine.step(snapshot=lambda rid: rid % 2 == 0)])
    while engine.has_unfinished():
        log.append([_fields(o) for o in engine.step()])
    return log


def test_step_api_with_arrivals_aborts_and_new_weights_matches(eos_model, tiny_model):
    from safetensors.torch import load_file

    other = load_file(str(tiny_model("llama", seed=1) / "model.safetensors"))
    sampled = SamplingParams(temperature=1.0, max_new_tokens=20, seed=5, n=2)
    script = [
        ("add", ([5, 6, 7, 8], SamplingParams(temperature=0.0, max_new_tokens=25))),
        ("add", (PROMPTS[2], sampled)),
        ("step", 3),
        ("add", ("the carry", SamplingParams(temperature=0.0, max_new_tokens=12, stop=["e"]))),
        ("step", 4),
        ("abort", 1),  # a request whose samples are in the step launched ahead
        ("step", 2),
        ("weights", other),  # the step launched ahead ran with the old weights: it must not be used
        ("step", 3),
        ("add", (PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=8, seed=9))),
    ]
    sync, lookahead = _pair(eos_model, max_num_seqs=8)
    want = _drive(sync, script)
    assert _drive(lookahead, script) == want
    assert lookahead.ahead_stats.used > 0
    assert lookahead.block_manager.num_free_blocks == lookahead.num_kv_blocks


def test_exact_logprobs_mode_matches(tiny_model):
    """Exact log-probs (batch-invariant ops) with async scheduling: the synchronous loop's outputs."""
    sync, lookahead = _pair(tiny_model("qwen3"), exact_logprobs=True)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=6 + 4 * i, seed=i, stop_token_ids=[40, 41, 42])
        for i in range(len(PROMPTS))
    ]
    _assert_same(sync.generate(PROMPTS, params), lookahead.generate(PROMPTS, params))
    assert lookahead.ahead_stats.used > 0


def test_serve_engine_loop_gets_the_synchronous_outputs(eos_model):
    """``tidal serve``'s engine thread drives ``step()``: a streaming request alone in the engine gets the
    same snapshots and final output as with the synchronous loop."""
    import queue

    from tidal.serve.engine_loop import EngineLoop

    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, n=2, stop=["e"])
    results, engines = [], _pair(eos_model)
    for engine in engines:
        events: queue.SimpleQueue = queue.SimpleQueue()
        loop = EngineLoop(engine).start()
        try:
            loop.submit(PROMPTS[2], params, events.put, stream=True).result(timeout=60)
            outputs = [events.get(timeout=60)]
            while not outputs[-1].finished:
                outputs.append(events.get(timeout=60))
        finally:
            loop.close()
        results.append([_fields(o) for o in outputs])
    assert results[0] == results[1] and len(results[0]) > 2
    assert engines[1].ahead_stats.used > 0


def test_synchronous_fallbacks(tiny_model):
    path = tiny_model("qwen2")
    config = cpu_config(max_model_len=96, block_size=4, async_scheduling=True)
    for field in ("enable_prefix_caching", "record_routing"):
        assert async_fallback(cpu_config(async_scheduling=True, **{field: True})) == field
    assert async_fallback(config) is None
    cached = LLMEngine(path, cpu_config(max_model_len=96, block_size=4, async_scheduling=True,
                                        enable_prefix_caching=True))  # fmt: skip
    assert not cached.async_scheduling
    # A repetition penalty needs each step's token on the host: those steps stay synchronous.
    sync, lookahead = _pair(path)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=0, repetition_penalty=1.3)
    _assert_same(sync.generate(PROMPTS, params), lookahead.generate(PROMPTS, params))
    assert lookahead.ahead_stats.launched == 0
    assert config.async_scheduling and lookahead.async_scheduling
    # The default (None): on where the host's work can overlap the device's (CUDA), off on the CPU.
    assert not LLMEngine(path, cpu_config(max_model_len=96, block_size=4)).async_scheduling


def test_policy_stops_launching_ahead_while_sequences_keep_stopping(tiny_model):
    policy = AheadPolicy()
    for _ in range(4):
        policy.update(True)
    assert not policy.launch  # 4 misses in a row: the rate passed 0.2
    for _ in range(20):
        policy.update(False)
    assert policy.launch
    # An engine whose samples stop often (a fifth of the vocabulary stops them) launches fewer steps
    # ahead than it runs decode steps, with the same outputs.
    sync, lookahead = _pair(tiny_model("qwen2"), max_num_seqs=32)
    lookahead.ahead_policy = AheadPolicy()
    decode_steps = []
    postprocess = lookahead.scheduler.postprocess
    lookahead.scheduler.postprocess = lambda batch, *out: (
        decode_steps.append(not batch.is_prefill),
        postprocess(batch, *out),
    )[1]
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=0, n=8, stop_token_ids=range(400, 500))
    _assert_same(sync.generate(PROMPTS, params), lookahead.generate(PROMPTS, params))
    assert 0 < lookahead.ahead_stats.launched < sum(decode_steps) - 1


def test_inputs_of_a_step_launched_ahead():
    seqs = [Sequence(i, i, 0, [7] * (3 + i), SamplingParams(), 0) for i in range(2)]
    for seq, blocks in zip(seqs, ([4], [5, 6]), strict=True):
        seq.block_table = blocks
    out = np.full(64, -1, dtype=np.int32)
    view = fill_decode_inputs(seqs, rows=4, width=2, out=out, ahead=([2, 0], 3))
    # Rows of the previous step's ids (padding: one past its end), contexts one token longer, tables.
    assert view.tolist() == [2, 0, 3, 3, 4, 5, 0, 0, 4, 0, 5, 6, 0, 0, 0, 0]
    assert ahead_input_ids(torch.tensor([11, 12, 13]), torch.tensor(view[:4])).tolist() == [13, 11, 0, 0]


def test_step_launched_ahead_as_sent_to_the_other_tp_ranks():
    """The copy of a decode step the driver sends (pickled) to the other ranks: without the sampled ids,
    which are on its device only, but with their count and the driver's rank, which broadcasts them."""
    staged = np.zeros(8, dtype=np.int32)
    step = DecodeStep(staged, 2, 2, 2, False, buffer=1, ahead=torch.tensor([11, 12, 13]))
    sent = pickle.loads(pickle.dumps(step.for_peers(rank=3)))
    assert (sent.ahead, sent.ahead_rows, sent.root, sent.buffer) == (None, 3, 3, 1)
    assert step.ahead is not None and step.ahead_rows == 0  # the driver's own step is left as it was
    plain = DecodeStep(staged, 2, 2, 2, False)
    assert plain.for_peers(rank=3) is plain  # not launched ahead: nothing to broadcast


def test_returned_blocks_restore_the_free_queue():
    manager = BlockManager(num_blocks=8, block_size=4)
    seqs = [Sequence(i, i, 0, [1, 2, 3, 4], SamplingParams(), 0) for i in range(2)]
    manager.allocate(seqs[:1])
    manager.allocate(seqs[1:])
    before = list(manager.free_blocks)
    taken = [manager.take_block(seq) for seq in seqs]
    assert taken == before[:2] and seqs[1].block_table[-1] == taken[1]
    for seq in reversed(seqs):
        manager.return_block(seq)
    assert list(manager.free_blocks) == before and all(len(seq.block_table) == 1 for seq in seqs)
    assert [manager.ref_counts[b] for b in taken] == [0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_matches_the_synchronous_loop(eos_model, enforce_eager):
    """On the GPU (CUDA graphs or eager): bit-identical tokens and log-probs, steps launched ahead used."""
    config = dict(
        device="cuda", dtype="bfloat16", max_model_len=96, block_size=4, enforce_eager=enforce_eager
    )
    sync = LLMEngine(eos_model, EngineConfig(**config))
    lookahead = LLMEngine(eos_model, EngineConfig(async_scheduling=True, **config))
    lookahead.ahead_policy.max_miss_rate = 1.0
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], list(range(5, 65))] * 6
    params = _mixed_params(stop="e") * 6
    want = sync.generate(prompts, params)
    got = lookahead.generate(prompts, params)
    _assert_same(want, got)
    assert 0 < lookahead.ahead_stats.used < lookahead.ahead_stats.launched
    assert lookahead.runner.graphs is None if enforce_eager else lookahead.runner.graphs.graphs


# --- Families with per-sequence recurrent states (Qwen3.5's Gated DeltaNet layers, state_cache.py) -----------

HYBRID_FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text"]


def _with_eos(path, directory, prompt, index: int = 9):
    """A copy of a model folder whose eos is the token its greedy output for ``prompt`` has at ``index``."""
    greedy = LLMEngine(path, cpu_config(max_model_len=96)).generate(
        [prompt], SamplingParams(temperature=0.0, max_new_tokens=index + 1, ignore_eos=True)
    )
    eos = greedy[0].outputs[0].token_ids[index]
    copy = shutil.copytree(path, directory / "eos_model")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((copy / name).read_text())
        config["eos_token_id"] = eos
        (copy / name).write_text(json.dumps(config))
    return copy


def _live_discards(monkeypatch) -> list[int]:
    """Spy on ``Lookahead.matches``: for each step launched ahead and then discarded, how many of its
    sequences were still running (the steps whose recurrent states a discard must leave intact)."""
    from tidal.rollout.scheduling.scheduler import Lookahead

    counts, matches = [], Lookahead.matches

    def spy(plan, batch):
        kept = matches(plan, batch)
        if not kept:
            counts.append(sum(not seq.is_finished for seq in plan.seqs))
        return kept

    monkeypatch.setattr(Lookahead, "matches", spy)
    return counts


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_recurrent_state_families_match_the_synchronous_loop(
    family, tiny_model, tmp_path_factory, monkeypatch
):
    """Qwen3.5 (dense and MoE) launches decode steps ahead with its recurrent states double buffered: steps
    launched ahead and discarded while their sequences go on (another stopped; a request came, was aborted;
    new weights between steps, as partial rollouts load them; preemption) leave the states the synchronous
    loop has, so tokens and log-probs are bit for bit the synchronous loop's. Updating the states in place
    instead (the old behaviour) changes them."""
    from safetensors.torch import load_file

    path = _with_eos(tiny_model(family, logit_scale=4.0), tmp_path_factory.mktemp(family), PROMPTS[1])
    sync, lookahead = _pair(path, max_num_seqs=8)
    assert lookahead.async_scheduling and lookahead.runner.states.double
    discards = _live_discards(monkeypatch)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], list(range(5, 65))]
    params = _mixed_params(stop="e")
    want = sync.generate(prompts, params)
    _assert_same(want, lookahead.generate(prompts, params))
    assert any(discards), "a step launched ahead should be discarded while its sequences go on"
    assert lookahead.block_manager.state_slots.num_free == 8  # every pair of slots given back

    # The step-level API: arrivals, an abort of a request in the step launched ahead, new weights.
    other = load_file(str(tiny_model(family, seed=1, logit_scale=4.0) / "model.safetensors"))
    script = [
        ("add", (PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=25))),
        ("add", (PROMPTS[2], SamplingParams(temperature=1.0, max_new_tokens=20, seed=5, n=2))),
        ("step", 3),
        ("add", ([7, 8, 9], SamplingParams(temperature=0.0, max_new_tokens=12, stop=["e"]))),
        ("step", 4),
        ("abort", 1),
        ("step", 2),
        ("weights", other),
        ("step", 3),
        ("add", (PROMPTS[3], SamplingParams(temperature=1.0, max_new_tokens=8, seed=9))),
    ]
    sync_weights = {k: v.clone() for k, v in sync.model.state_dict().items()}
    first = _drive(sync, script)
    assert _drive(lookahead, script) == first
    for engine in (sync, lookahead):  # back to the first weights for what follows
        engine.model.load_state_dict(sync_weights)

    # Partial rollouts: new weights loaded between two steps of ``generate`` (LLMEngine.between_steps).
    def update_at(engine, step: int):
        calls = []

        def between(groups):
            calls.append(1)
            if len(calls) == step:
                engine.update_weights(other)

        return between

    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7, n=2, ignore_eos=True)
    results = []
    for engine in (sync, lookahead):
        engine.between_steps = update_at(engine, 4)
        results.append(engine.generate(PROMPTS, sampled))
        engine.between_steps = None
        engine.model.load_state_dict(sync_weights)
    _assert_same(*results)

    # In place (one slot per sequence, as before double buffering): a discarded step corrupts the states.
    states = lookahead.runner.states

    def in_place(seqs, rows, ahead, out):
        out[: 2 * rows] = states.pad_slot
        out[: len(seqs)] = out[rows : rows + len(seqs)] = [seq.state_slot for seq in seqs]

    monkeypatch.setattr(states, "decode_slots", in_place)
    monkeypatch.setattr(lookahead.block_manager.state_slots, "flip", lambda seqs: None)
    assert [_fields(o) for o in lookahead.generate(prompts, params)] != [_fields(o) for o in want]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_recurrent_state_families_under_preemption_match(family, tiny_model):
    """A tiny KV cache: sequences are preempted (their slot pairs freed, their states recomputed) while
    steps run ahead; the synchronous loop's outputs."""
    sync, lookahead = _pair(tiny_model(family, logit_scale=4.0), max_num_seqs=4, num_kv_blocks=12)
    preempted = []
    original = lookahead.scheduler._preempt
    lookahead.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    prompts = [list(range(20 + i, 29 + 2 * i)) for i in range(5)]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=14 + 3 * i, seed=i, ignore_eos=True) for i in range(5)
    ]
    _assert_same(sync.generate(prompts, params), lookahead.generate(prompts, params))
    assert preempted and lookahead.ahead_stats.used > 0
    assert lookahead.block_manager.state_slots.num_free == 4
