"""Tensor-parallel Qwen3.5 engines (``EngineConfig.tp_size`` 2: two CPU processes over gloo) against one
process, for ``qwen3_5_text`` and ``qwen3_5_moe_text``: each rank runs half of the Gated DeltaNet key and
value heads (and keeps only their conv and recurrent states) and half of the gated full-attention heads.
Same greedy tokens and log-probs within 1e-5 on a mixed-length batch (decode steps launched ahead, async
scheduling, some discarded), the same seeded n=2 samples, and
after ``update_weights`` with HF names (a checkpoint's, a trainer's stacked experts) the same as one
process loaded from the new weights, also after a sleep and wake-up; a size that does not divide the
linear-attention heads is refused in one line before any process starts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout.reference import PROMPTS, assert_same_outputs, cpu_config
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.models.loader import iter_checkpoint, tp_layout_problem
from tidal.testing.tiny import tiny_config

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=7)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=4)  # after a weight sync (each TP step is slow on CPU)


def config(tp_size: int, **overrides):
    return cpu_config(max_model_len=96, block_size=4, tp_size=tp_size, **overrides)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_tp2_qwen3_5_matches_one_process_and_syncs_weights(tiny_model, family):
    old, new = tiny_model(family, vocab_size=501), tiny_model(family, seed=1, vocab_size=501)
    tp = LLMEngine(old, config(2, async_scheduling=True))
    tp.ahead_policy.max_miss_rate = 1.0  # keep launching ahead despite the discards
    try:
        single = LLMEngine(old, config(1))
        # Each rank holds the states of its 2 of the 4 value heads and its half of the conv channels.
        for name in ("recurrent", "conv"):
            local, full = getattr(tp.runner.states, name), getattr(single.runner.states, name)
            assert local.shape[2] * 2 == full.shape[2]
        greedy = single.generate(PROMPTS, GREEDY)
        assert_same_outputs(greedy, tp.generate(PROMPTS, GREEDY))
        # Requests stopping at different steps on a token the scheduler cannot foresee: a decode step
        # launched ahead past a stop is discarded while the others go on (their double-buffered states
        # must stay as the kept step wrote them, on every rank).
        stops = [out.outputs[0].token_ids[k] for out, k in zip(greedy, (1, 4, 2, 6), strict=True)]
        staggered = [SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[t]) for t in stops]
        assert_same_outputs(single.generate(PROMPTS, staggered), tp.generate(PROMPTS, staggered))
        stats = tp.ahead_stats
        assert tp.async_scheduling and 0 < stats.used < stats.launched  # steps ran ahead, some discarded
        assert_same_outputs(single.generate(PROMPTS[:2], SAMPLED), tp.generate(PROMPTS[:2], SAMPLED))
        if family == "qwen3_5_moe_text":  # a trainer's weights: transformers' stacked expert tensors
            named = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).named_parameters()
        else:
            named = iter_checkpoint(new)
        assert tp.update_weights(named) > 0
        reference = LLMEngine(new, config(1)).generate(PROMPTS[1:3], SHORT)
        assert_same_outputs(reference, tp.generate(PROMPTS[1:3], SHORT))
        tp.sleep(level=2)
        tp.wake_up()
        assert_same_outputs(reference, tp.generate(PROMPTS[1:3], SHORT))
    finally:
        tp.close()


# The attention heads split (6 by 2; 4 by 4 with the 2 KV heads replicated) but the linear-attention
# key heads do not; the tiny shapes themselves split in two.
@pytest.mark.parametrize(
    ("overrides", "tp_size", "message"),
    [
        ({"linear_num_key_heads": 1}, 2, "tensor-parallel size 2 does not divide linear_num_key_heads=1"),
        ({"num_attention_heads": 4}, 4, "tensor-parallel size 4 does not divide linear_num_key_heads=2"),
        ({}, 2, None),
    ],
)
def test_qwen3_5_layout_refused_in_one_line(overrides, tp_size, message):
    assert tp_layout_problem(tiny_config("qwen3_5_text", **overrides), tp_size) == message


def test_qwen3_5_layout_refused_before_start(tiny_model):
    with pytest.raises(ValueError, match="tensor-parallel size 2 does not divide linear_num_key_heads=1"):
        LLMEngine(tiny_model("qwen3_5_text", linear_num_key_heads=1), config(2))


MANY = [PROMPTS[i % len(PROMPTS)] + [i + 1] for i in range(20)]  # several graph buckets as rows stop


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_tp2_qwen3_5_on_two_gpus_with_graphs_and_async(tiny_model, family):
    """On 2 GPUs: decode under CUDA graphs with async scheduling, the fused Triton decode kernel on each
    rank's heads (``k_heads`` local), equal to one GPU's tokens with log-probs within 1e-4, also after
    ``update_weights`` and a level-2 sleep and wake-up (graphs captured again)."""

    def cuda_config(tp_size: int):
        return EngineConfig(device="cuda", dtype="float32", max_model_len=96, tp_size=tp_size)

    path = tiny_model(family, vocab_size=501, logit_scale=4.0)  # peaked: no near-ties for greedy
    new = tiny_model(family, seed=1, vocab_size=501, logit_scale=4.0)
    one = LLMEngine(path, cuda_config(1))
    reference = one.generate(MANY, GREEDY), one.generate(PROMPTS[:2], SAMPLED)
    one.update_weights(iter_checkpoint(new))
    updated = one.generate(MANY, GREEDY)
    one.close()
    tp = LLMEngine(path, cuda_config(2))
    try:
        assert tp.runner.graphs is not None and tp.async_scheduling
        assert_same_outputs(reference[0], tp.generate(MANY, GREEDY), tol=1e-4)
        assert_same_outputs(reference[1], tp.generate(PROMPTS[:2], SAMPLED), tol=1e-4)
        tp.update_weights(iter_checkpoint(new))
        assert_same_outputs(updated, tp.generate(MANY, GREEDY), tol=1e-4)
        tp.sleep(level=2)
        tp.wake_up()
        assert_same_outputs(updated, tp.generate(MANY, GREEDY), tol=1e-4)
    finally:
        tp.close()
