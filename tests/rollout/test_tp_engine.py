"""A tensor-parallel engine (``EngineConfig.tp_size`` 2: two CPU processes over gloo) against one process:
the same greedy tokens and log-probs within 1e-5 on a mixed-length batch, the same seeded samples, the
same after ``update_weights`` and after sleep / wake-up; impossible layouts refused before any process
starts."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models.loader import iter_checkpoint
from tidal.rollout.runner import tp_worker

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=7)


def config(tp_size: int):
    return cpu_config(max_model_len=96, block_size=4, tp_size=tp_size)


def assert_same_outputs(reference, outputs) -> None:
    for ref, out in zip(reference, outputs, strict=True):
        for a, b in zip(ref.outputs, out.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.fixture
def tp_engine():
    """``tp_engine(path)``: a TP=2 engine, closed (workers stopped) after the test."""
    engines = []

    def build(path):
        engines.append(LLMEngine(path, config(2)))
        return engines[-1]

    yield build
    for engine in engines:
        engine.close()


# llama: 2 KV heads split 1 + 1; qwen3: q/k norms per head; llama with 1 KV head: replicated on both
# ranks; olmo2 with 1 KV head: q/k norms over the whole (sharded) projections, the KV head counted once.
@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("qwen3", {}),
        ("llama", {"num_key_value_heads": 1}),
        ("olmo2", {"num_key_value_heads": 1}),
    ],
    ids=["llama", "qwen3", "llama-kv1", "olmo2-kv1"],
)
def test_tp2_matches_one_process(tiny_model, tp_engine, family, overrides):
    path = tiny_model(family, vocab_size=501, **overrides)  # 501: the vocabulary splits unevenly
    single, tp = LLMEngine(path, config(1)), tp_engine(path)
    assert tp.runner.kv_cache.shape[-2] == max(1, single.runner.kv_cache.shape[-2] // 2)
    assert_same_outputs(single.generate(PROMPTS, GREEDY), tp.generate(PROMPTS, GREEDY))
    assert_same_outputs(single.generate(PROMPTS[:2], SAMPLED), tp.generate(PROMPTS[:2], SAMPLED))


def test_bucket_packing_round_trips_mixed_dtypes():
    """Weights travel packed in buckets of bytes: every tensor comes back equal, whatever dtypes and odd
    sizes precede it (each starts at an aligned offset its dtype can view)."""
    tensors = [torch.arange(3, dtype=torch.bfloat16), torch.randn(2, 3), torch.tensor(7, dtype=torch.int64),
               torch.ones(5, dtype=torch.float16), torch.randn(4, 1, dtype=torch.float64)]  # fmt: skip
    meta = [(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    unpacked = list(tp_worker.unpack(tp_worker.pack(tensors, meta).clone(), meta))
    assert [name for name, _ in unpacked] == [name for name, _, _ in meta]
    for (_, got), want in zip(unpacked, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    chunks = list(
        tp_worker.buckets([(m[0], t) for m, t in zip(meta, tensors, strict=True)], torch.device("cpu"), 30)
    )
    assert [len(b) for b in chunks] == [2, 3]  # 6 + 24 bytes reach 30; then 8 + 10 + 32


def test_tp2_update_weights_and_sleep(tiny_model, tp_engine, monkeypatch):
    """New weights reach both ranks (each keeps its shard), in several buckets of several tensors: TP=2
    then equals TP=1 built from them; a level-2 sleep and wake-up keeps them."""
    old, new = tiny_model("llama", vocab_size=501), tiny_model("llama", seed=1, vocab_size=501)
    tp = tp_engine(old)
    monkeypatch.setattr(tp_worker, "BUCKET_BYTES", 64 * 1024)  # rank 0 decides the buckets
    assert tp.update_weights(iter_checkpoint(new)) > 0
    reference = LLMEngine(new, config(1)).generate(PROMPTS, GREEDY)
    assert_same_outputs(reference, tp.generate(PROMPTS, GREEDY))
    tp.sleep(level=2)
    tp.wake_up()
    assert_same_outputs(reference, tp.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize(
    ("family", "overrides", "tp_size", "message"),
    [
        ("llama", {}, 4, "tensor-parallel size 4 does not divide num_attention_heads=6"),
        ("llama", {"num_key_value_heads": 3}, 2, "num_key_value_heads=3"),
    ],
)
def test_impossible_layout_refused_before_start(tiny_model, family, overrides, tp_size, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(tiny_model(family, **overrides), config(tp_size))


def test_a_worker_that_cannot_start_fails_the_engine(tiny_model, monkeypatch):
    """A rank that exits during start-up raises on rank 0 (its traceback is on stderr), no waiting."""
    real_popen = tp_worker.subprocess.Popen
    monkeypatch.setattr(
        tp_worker.subprocess,
        "Popen",
        lambda command: real_popen([sys.executable, "-c", "raise SystemExit(3)"]),
    )
    with pytest.raises(RuntimeError, match=r"tensor-parallel engine rank 1 exited \(code 3\) while starting"):
        LLMEngine(tiny_model("llama"), config(2))
