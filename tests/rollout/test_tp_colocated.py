"""A TP=2 engine that spans two training processes (``tp_worker.colocated_group``, gloo): each rank drives
its own prompts in its turn while the other serves them on its shard, and gets what a one-process engine
gives for those prompts; each rank loads new weights itself (``update_weights``) with the same result; a
turn that fails raises on its rank without stopping the other's. With async scheduling (CUDA's default) the
serving rank takes the input ids of the steps launched ahead from the driver's by broadcast."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models.loader import iter_checkpoint
from tidal.rollout.runner.tp_worker import colocated_group

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def outputs(results) -> list[tuple[list[int], list[float]]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in results]


def rank_main(rank: int, port: int, path: str, new_path: str, out: dict, async_scheduling: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    config = cpu_config(max_model_len=64, block_size=4, tp_size=2, async_scheduling=async_scheduling)
    engine = LLMEngine(path, config, tp_group=colocated_group(2, torch.device("cpu")))
    assert engine.async_scheduling == async_scheduling
    mine = PROMPTS[rank::2]  # each training rank its share of the prompts
    before = engine.take_turns(lambda: engine.generate(mine, GREEDY))
    engine.update_weights(iter_checkpoint(new_path))
    engine.sleep()
    engine.wake_up()
    after = engine.take_turns(lambda: engine.generate(mine, GREEDY))
    # a failing turn (rank 0's prompt is out of the vocabulary) raises there; the other rank's turn runs
    try:
        again = outputs(engine.take_turns(lambda: engine.generate([[10**6]] if rank == 0 else mine, GREEDY)))
    except ValueError as err:
        again = str(err)
    out[rank] = (outputs(before), outputs(after), again, engine.ahead_stats.used)
    dist.destroy_process_group()


def free_port() -> int:
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    port = store.port
    del store
    return port


# Async scheduling only: CUDA's default, and the harder path; the synchronous one (the CPU default) runs
# in tests/rollout/test_tp_rl.py's colocated RL run.
@pytest.mark.parametrize("async_scheduling", [True], ids=["async"])
def test_engine_spanning_two_training_processes(tiny_model, async_scheduling):
    old, new = tiny_model("llama", vocab_size=501), tiny_model("llama", seed=1, vocab_size=501)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(free_port(), str(old), str(new), out, async_scheduling), nprocs=2)
        results = dict(out)
    assert all((results[rank][3] > 0) == async_scheduling for rank in (0, 1))  # steps launched ahead, used
    assert "outside [0, 501)" in results[0][2]
    assert results[1][2] == results[1][1]
    for rank in (0, 1):
        for path, got in zip((old, new), results[rank][:2], strict=True):
            expected = outputs(LLMEngine(path, cpu_config(max_model_len=64, block_size=4)).generate(
                PROMPTS[rank::2], GREEDY))  # fmt: skip
            for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
                assert tokens == want_tokens
                assert torch.allclose(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=0)
