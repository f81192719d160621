"""The engine captures its decode graphs lazily, one batch size at a time, and with ``--async_train`` it does
so while the trainer works in another thread of the same process. A capture in CUDA's default (global)
mode makes the other thread's ``cudaMalloc`` fail ("operation not permitted when stream is capturing"),
which killed an async GRPO run on the H200; the engine captures in thread-local mode. Here a thread keeps
allocating fresh device memory (the caching allocator emptied each time, so every allocation is a
``cudaMalloc``) while the engine captures a graph for each of several batch sizes: both must finish cleanly,
and the generation must equal the same engine's without the other thread."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.engine.config import EngineConfig

pytestmark = pytest.mark.gpu


def _generate(model, batches) -> list[list[int]]:
    engine = LLMEngine(
        str(model), EngineConfig(device="cuda", dtype="float32", max_model_len=64, max_num_seqs=32)
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = []
    for rows in batches:  # each new batch size captures a graph
        prompts = [[1 + (i * 7 + j) % 50 for j in range(5 + i % 3)] for i in range(rows)]
        out += [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    return out


def test_graph_captures_while_another_thread_allocates(tiny_qwen2):
    batches = [1, 3, 9, 17, 32]
    alone = _generate(tiny_qwen2, batches)
    stop, errors = threading.Event(), []

    def trainer_like():
        size = 1 << 20
        try:
            while not stop.is_set():
                torch.empty(size, device="cuda").fill_(1.0)
                torch.cuda.empty_cache()
                size = (1 << 20) + (size * 7 + 4096) % (1 << 24)
        except Exception as exc:  # noqa: BLE001 — reported by the assertion below
            errors.append(repr(exc))

    thread = threading.Thread(target=trainer_like)
    thread.start()
    try:
        beside = _generate(tiny_qwen2, batches)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert beside == alone
