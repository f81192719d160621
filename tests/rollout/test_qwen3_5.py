"""Qwen3.5 (``qwen3_5_text``): the gated delta rule against a naive float64 reference, and the hybrid engine
(linear-attention states beside the paged KV cache) against transformers: greedy tokens, log-probs, each
family feature mattering, batching, n samples, chunked prefill, preemption, sleep/wake and refusals."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.reference import PROMPTS, cpu_config, hf_greedy, hf_logprobs
from tidal.rollout import LLMEngine, SamplingParams
from tidal.rollout.models import qwen3_5
from tidal.rollout.models.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tidal.rollout.models.registry import feature_refusal

FAMILY = "qwen3_5_text"


def naive_rule(q, k, v, g, beta, state):
    """The rule as written in the Gated DeltaNet paper, one head and one token at a time, float64."""
    q, k, v, g, beta, state = (x.double() for x in (q, k, v, g, beta, state))
    batch, length, k_heads, k_dim = k.shape
    v_heads = v.shape[2]
    state = state.clone()
    out = torch.zeros(batch, length, v_heads, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(v_heads):
            kh = h // (v_heads // k_heads)
            for t in range(length):
                qt, kt = q[b, t, kh] / q[b, t, kh].norm(), k[b, t, kh] / k[b, t, kh].norm()
                s = state[b, h] * torch.exp(g[b, t, h])
                s = s + beta[b, t, h] * torch.outer(kt, v[b, t, h] - s.T @ kt)
                state[b, h] = s
                out[b, t, h] = s.T @ qt * k_dim**-0.5
    return out, state


@pytest.mark.parametrize("length", [1, 7, 8, 19])
def test_chunked_and_recurrent_rules_equal_the_naive_reference(length):
    """Odd lengths and chunk boundaries (chunks of 8), grouped value heads, a non-zero initial state."""
    gen = torch.Generator().manual_seed(length)
    batch, k_heads, v_heads, k_dim, v_dim = 2, 2, 4, 8, 6
    q, k = (torch.randn(batch, length, k_heads, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, length, v_heads, v_dim, generator=gen)
    g = -torch.rand(batch, length, v_heads, generator=gen) * 2
    beta = torch.rand(batch, length, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen)
    want_out, want_state = naive_rule(q, k, v, g, beta, state)
    for out, final in (
        chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=8),
        recurrent_gated_delta_rule(q, k, v, g, beta, state),
    ):
        torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=0)
        torch.testing.assert_close(final.double(), want_state, atol=2e-5, rtol=0)
    if length == 1:
        return
    # A sequence split in two (a chunked prefill) continues from the first part's state.
    cut = length // 2
    first, mid = chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)), state, chunk_size=8)
    second, end = chunk_gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), mid, chunk_size=8)
    torch.testing.assert_close(torch.cat((first, second), 1).double(), want_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(end.double(), want_state, atol=2e-5, rtol=0)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_model, hf_model):
    path = tiny_model(FAMILY, logit_scale=4.0)  # peaked logits: completions sensitive to every feature
    engine = LLMEngine(path, cpu_config(max_model_len=128, block_size=4, max_num_seqs=8))
    return path, hf_model(path), engine


def _same_as_hf(hf, prompt, sample) -> bool:
    ref = hf_greedy(hf, prompt, len(sample.token_ids))  # transformers stops at eos; compare up to there
    return sample.token_ids[: len(ref)] == ref


def test_greedy_and_logprobs_match_transformers_and_each_feature_matters(setup, monkeypatch):
    path, hf, engine = setup
    outputs = engine.generate(PROMPTS, greedy(12))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        sample = out.outputs[0]
        assert _same_as_hf(hf, prompt, sample)
        expected = hf_logprobs(hf, prompt, sample.token_ids)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)

    prompt, model = PROMPTS[0], engine.model
    want = engine.generate([prompt], greedy(20))[0].outputs[0]
    assert _same_as_hf(hf, prompt, want)

    def differs() -> bool:
        return engine.generate([prompt], greedy(20))[0].outputs[0].token_ids != want.token_ids

    # Left out one at a time, each feature changes the completion: the attention output gate, ...
    with monkeypatch.context() as m:
        m.setattr(qwen3_5.GatedAttention, "output_gate", lambda self, gate: torch.ones_like(gate))
        assert differs()
    # ... the partial rotary width (rotating whole heads instead), ...
    with monkeypatch.context() as m:
        m.setattr(model.args, "rotary_dim", model.args.head_dim)
        model.init_rope(engine.hf_config, engine.max_model_len)
        assert differs()
    model.init_rope(engine.hf_config, engine.max_model_len)
    # ... the recurrent state carried from the prompt into decode steps, ...
    rule = qwen3_5.gated_delta_rule
    with monkeypatch.context() as m:
        m.setattr(qwen3_5, "gated_delta_rule", lambda *a, recurrent=False: rule(*a[:5], None, recurrent))
        assert differs()
    # ... and the convolution's history.
    conv = qwen3_5.causal_conv
    with monkeypatch.context() as m:
        m.setattr(qwen3_5, "causal_conv", lambda x, history, w: conv(x, torch.zeros_like(history), w))
        assert differs()
    assert not differs()  # everything restored


def test_batching_n_samples_and_chunked_prefill_equal_one_at_a_time(setup, tiny_model):
    path, hf, engine = setup
    alone = [engine.generate([p], greedy(10))[0].outputs[0].token_ids for p in PROMPTS]
    batched = [out.outputs[0].token_ids for out in engine.generate(PROMPTS, greedy(10))]
    assert batched == alone
    # n samples share one prefill: each sample's state is a copy of the prompt's.
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=3, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:2], engine.generate(PROMPTS[:2], params), strict=True):
        assert len({tuple(s.token_ids) for s in out.outputs}) > 1
        for sample in out.outputs:
            expected = hf_logprobs(hf, prompt, sample.token_ids, temperature=1.0)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)
    # Chunked prefill: a prompt split over steps of 7 tokens continues its state chunk to chunk.
    chunked = LLMEngine(
        path,
        cpu_config(max_model_len=128, block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=7),
    )
    two = SamplingParams(temperature=0.0, max_new_tokens=10, n=2, ignore_eos=True)
    for out, want in zip(chunked.generate(PROMPTS, two), alone, strict=True):
        assert [s.token_ids for s in out.outputs] == [want, want]


def test_preemption_sleep_and_slots(setup, monkeypatch):
    path, _, engine = setup
    prompts = [list(range(20 + i, 29 + 2 * i)) for i in range(5)]
    want = [out.outputs[0].token_ids for out in engine.generate(prompts, greedy(14))]
    tiny = LLMEngine(path, cpu_config(max_model_len=128, block_size=4, max_num_seqs=4, num_kv_blocks=12))
    preempted = []
    original = tiny.scheduler._preempt
    monkeypatch.setattr(tiny.scheduler, "_preempt", lambda seq: (preempted.append(seq), original(seq)))
    assert [out.outputs[0].token_ids for out in tiny.generate(prompts, greedy(14))] == want
    assert preempted, "the test should exercise preemption"
    slots = tiny.block_manager.state_slots
    assert slots.num_free == 4 and tiny.block_manager.num_free_blocks == 12  # every slot given back
    # An aborted request gives its slots back too; the next request reuses one (its prefill starts from
    # zeros, not from what the slot held).
    aborted = tiny.add_request(prompts[0], SamplingParams(max_new_tokens=30, n=2, ignore_eos=True))
    kept = tiny.add_request(prompts[1], greedy(14))
    for _ in range(3):
        tiny.step()
    assert slots.num_free == 1 and tiny.abort(aborted) and slots.num_free == 3
    while tiny.has_unfinished():
        finished = tiny.step()
    assert finished[0].request_id == kept and finished[0].outputs[0].token_ids == want[1]
    assert slots.num_free == 4
    tiny.sleep()
    assert tiny.runner.states.conv is None
    tiny.wake_up()
    assert [out.outputs[0].token_ids for out in tiny.generate(prompts[:2], greedy(14))] == want[:2]


def test_refused_features_say_why(setup):
    path = setup[0]
    # Prefix caching is supported (saved states at block boundaries: test_hybrid_prefix_cache.py).
    assert feature_refusal(FAMILY, "prefix_caching") is None
    # Tensor parallelism is supported (the linear-attention heads split by rank: test_tp_qwen3_5.py).
    assert feature_refusal(FAMILY, "tensor_parallel") is None
    with pytest.raises(ValueError, match=f"exact_logprobs supports the .* families, not '{FAMILY}'"):
        LLMEngine(path, cpu_config(exact_logprobs=True))
    # CUDA graphs and async scheduling are supported (test_qwen3_5_graphs.py, test_async_scheduling.py).
    assert (
        feature_refusal(FAMILY, "cuda_graphs") is None and feature_refusal(FAMILY, "async_scheduling") is None
    )
