"""The CUDA-graph decode path's host-side logic, on CPU: bucketing, input staging and padding rows.

A CPU stand-in replaces the captured graph with an eager re-run on the same static buffers, so padding
rows (context 0, KV written to the reserved padding block) and the staging copies are checked here;
``test_gpu.py`` checks real graph replay against eager mode.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from tests.rollout.reference import cpu_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.runner.cuda_graph import DecodeGraphs, batch_buckets
from tidal.rollout.runner.steps import fill_decode_inputs
from tidal.rollout.scheduling.sequence import Sequence

REQUESTS = [(list(range(3 + i, 3 + i + 2 + 3 * i)), 3 + (5 * i) % 11) for i in range(7)]


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_fill_decode_inputs_pads_rows_and_tables():
    params = SamplingParams()
    a = Sequence(0, 0, 0, [7, 8, 9], params, 0)
    b = Sequence(1, 1, 0, [4], params, 0)
    a.block_table, b.block_table = [5, 2], [3]
    out = np.full(64, -1, dtype=np.int32)
    view = fill_decode_inputs([a, b], rows=4, width=2, out=out)
    assert view.tolist() == [9, 4, 0, 0, 3, 1, 0, 0, 5, 2, 3, 0, 0, 0, 0, 0]


def _eager_stand_in(self, rows):
    """Replaces ``DecodeGraphs._capture``: "replay" re-runs the forward into a fixed logits buffer."""
    inputs = (self.input_ids[:rows], self.context_lens[:rows], self.block_tables[:rows])
    self.input_ids.zero_()
    self.context_lens.zero_()
    logits = self.forward(*inputs).clone()

    class Replay:
        def replay(_):
            logits.copy_(self.forward(*inputs))

    self.graphs[rows] = (Replay(), logits)
    return self.graphs[rows]


def test_padded_bucket_path_matches_plain_decode(tiny_model):
    path = tiny_model("qwen2")
    config = cpu_config(max_model_len=64, max_num_seqs=6, block_size=4)
    plain = LLMEngine(path, config)
    padded = LLMEngine(path, config)
    runner = padded.runner
    runner.graphs = DecodeGraphs(runner.decode_forward, runner.device, 6, 64 // 4)
    runner.graphs._capture = types.MethodType(_eager_stand_in, runner.graphs)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for _, n in REQUESTS]
    sampled = SamplingParams(temperature=1.0, top_p=0.9, n=3, max_new_tokens=9, seed=3, ignore_eos=True)
    for engine in (plain, padded):
        engine.outputs = engine.generate([p for p, _ in REQUESTS], params)
        engine.outputs += engine.generate([REQUESTS[2][0]], sampled)
    assert set(runner.graphs.graphs) > {6, 4}  # the batch shrank through padded buckets
    for ours, ref in zip(padded.outputs, plain.outputs, strict=True):
        for a, b in zip(ours.outputs, ref.outputs, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert padded.block_manager.num_free_blocks == padded.num_kv_blocks
