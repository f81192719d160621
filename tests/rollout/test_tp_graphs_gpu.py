"""A tensor-parallel engine on 2 GPUs replays decode CUDA graphs that capture its NCCL collectives: its
greedy tokens equal one GPU's (and the eager TP=2 engine's) with log-probs within 1e-4, over batches that
shrink through several graph buckets, after ``update_weights`` (in place: the graphs stay valid) and after
a level-2 sleep and wake-up (the graphs are dropped and captured again)."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, assert_same_outputs
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.models.loader import iter_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

# 20 prompts of mixed lengths: 20 rows (bucket 32), fewer as sequences stop at EOS (smaller buckets).
MANY = [PROMPTS[i % len(PROMPTS)] + [i + 1] for i in range(20)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5)


def cuda_config(tp_size: int, **overrides) -> EngineConfig:
    return EngineConfig(device="cuda", dtype="float32", max_model_len=96, tp_size=tp_size, **overrides)


def test_tp2_graphs_match_one_gpu_and_eager(tiny_model):
    path = tiny_model("qwen2", vocab_size=501, logit_scale=4.0)  # peaked: no near-ties for greedy
    new = tiny_model("qwen2", seed=1, vocab_size=501, logit_scale=4.0)
    one = LLMEngine(path, cuda_config(1))
    reference = one.generate(MANY, GREEDY), one.generate(PROMPTS[:2], SAMPLED)
    one.update_weights(iter_checkpoint(new))
    updated = one.generate(MANY, GREEDY)
    one.close()

    eager = LLMEngine(path, cuda_config(2, enforce_eager=True))
    try:
        assert eager.runner.graphs is None
        assert_same_outputs(reference[0], eager.generate(MANY, GREEDY), tol=1e-4)
    finally:
        eager.close()

    tp = LLMEngine(path, cuda_config(2))
    try:
        graphs = tp.runner.graphs
        assert graphs is not None
        assert_same_outputs(reference[0], tp.generate(MANY, GREEDY), tol=1e-4)
        assert len(graphs.graphs) >= 2  # the batch went through several buckets, each captured on both ranks
        assert_same_outputs(reference[1], tp.generate(PROMPTS[:2], SAMPLED), tol=1e-4)
        tp.update_weights(iter_checkpoint(new))
        assert_same_outputs(updated, tp.generate(MANY, GREEDY), tol=1e-4)
        tp.sleep(level=2)
        assert not graphs.graphs
        tp.wake_up()
        assert_same_outputs(updated, tp.generate(MANY, GREEDY), tol=1e-4)
        assert graphs.graphs
    finally:
        tp.close()
