"""Sampling follows the exact distribution: chi-square tests against known probabilities, not comparisons
of one implementation with another.

Every test is deterministic (the noise is a hash of fixed seeds), so the thresholds are fixed: an honest
sampler gives z-scores of a few at most; a biased one (such as a kernel reading the wrong per-row
temperature) gives tens to hundreds. The CUDA versions (fused Triton kernel, CUDA graphs) are in
``test_sampling_stats_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.model_runner import ModelRunner
from tidal.rollout.runner.sampler import U_MAX, Sampler, SamplingTensors, sequence_seed, uniform_noise
from tidal.testing.sampling_check import check_engine_sampling
from tidal.testing.stats import expected_distinct, goodness_of_fit, mean_z, truncated_probs

Z_MAX = 5.0  # one-sided p ~ 3e-7 for an honest sampler


def known_logits(kind: str, vocab: int) -> torch.Tensor:
    """Distributions of different shapes: peaked (p_max ~0.6), Zipf-like, and nearly flat."""
    g = torch.Generator().manual_seed(vocab)
    if kind == "peaked":
        logits = torch.randn(vocab, generator=g)
        logits[:5] += torch.tensor([6.0, 4.5, 4.0, 3.0, 2.0])
        return logits
    if kind == "zipf":
        return (
            -1.1
            * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))[torch.randperm(vocab, generator=g)]
        )
    return 0.1 * torch.randn(vocab, generator=g)


def sample_rows(logits: torch.Tensor, rows: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, n=8):
    """``rows`` samples of one distribution through ``Sampler``: rows are the n samples of rows/n seeded
    requests, at output position 3 (seeds as the engine derives them)."""
    vocab = logits.numel()
    seeds = torch.tensor([sequence_seed(r // n, r % n) for r in range(rows)], dtype=torch.int64)
    full = lambda v, dtype=torch.float32: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    st = SamplingTensors(
        all_greedy=False,
        any_truncation=top_k > 0 or top_p < 1 or min_p > 0,
        temperatures=full(temperature),
        top_k=full(top_k if top_k > 0 else vocab, torch.int64),
        top_p=full(top_p),
        min_p=full(min_p),
        seeds=seeds,
        positions=full(3, torch.int64),
    )
    tokens, logprobs = Sampler()(logits.repeat(rows, 1), st)
    return tokens, logprobs


@pytest.mark.parametrize(
    "kind, vocab, temperature",
    [
        ("peaked", 1000, 0.6),
        ("peaked", 1000, 1.0),
        ("peaked", 1000, 1.7),
        ("zipf", 2000, 1.0),
        ("flat", 300, 1.3),
    ],
)
def test_samples_follow_softmax_of_logits_over_temperature(kind, vocab, temperature):
    logits = known_logits(kind, vocab)
    tokens, logprobs = sample_rows(logits, 8192, temperature=temperature)
    probs = truncated_probs(logits, temperature)
    fit = goodness_of_fit(torch.bincount(tokens, minlength=vocab), probs)
    assert fit.z < Z_MAX, fit
    torch.testing.assert_close(logprobs, (logits / temperature).log_softmax(-1)[tokens])


@pytest.mark.parametrize(
    "truncation",
    [dict(top_k=5), dict(top_p=0.7), dict(min_p=0.05), dict(top_k=50, top_p=0.9, min_p=0.01)],
)
def test_truncated_samples_follow_the_renormalised_distribution(truncation):
    logits = known_logits("zipf", 1000)
    tokens, _ = sample_rows(logits, 6144, temperature=0.9, **truncation)
    probs = truncated_probs(logits, 0.9, **truncation)
    fit = goodness_of_fit(torch.bincount(tokens, minlength=1000), probs)
    assert fit.outside_support == 0 and fit.z < Z_MAX, fit
    assert 2 <= (probs > 0).sum() < 1000  # the truncation did cut


def test_noise_is_never_one():
    """``(2**24 - 1) + 0.5`` rounds to ``2**24`` in float32: that draw gave u = 1.0, an infinite Gumbel
    noise that won against any logits, even truncated ones (about 1% of rows at a 152k vocabulary)."""
    seed = torch.tensor([sequence_seed(318, 6)])  # a (seed, position, token) whose hash hits the top value
    u = uniform_noise(seed, torch.tensor([3]), 2000)
    assert u[0, 32] == U_MAX < 1.0
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_samples_of_one_request_are_as_diverse_as_independent_draws():
    logits = known_logits("peaked", 1000)
    n = 8
    tokens, _ = sample_rows(logits, 8192, n=n)
    distinct = torch.tensor([len(set(g.tolist())) for g in tokens.view(-1, n)], dtype=torch.float64)
    want = expected_distinct(logits.softmax(-1), n)
    assert abs(mean_z(distinct, want)) < Z_MAX, (distinct.mean().item(), want)


def test_goodness_of_fit_flags_a_biased_sampler():
    """The check itself has power: a sampler that draws a third of its rows greedily (what reading the
    wrong per-row temperature did on CUDA) fails by far, an honest one passes."""
    logits = known_logits("peaked", 1000)
    tokens, _ = sample_rows(logits, 8192)
    biased = tokens.clone()
    biased[::3] = int(logits.argmax())
    probs = logits.softmax(-1)
    assert goodness_of_fit(torch.bincount(tokens, minlength=1000), probs).z < Z_MAX
    assert goodness_of_fit(torch.bincount(biased, minlength=1000), probs).z > 50


def test_runner_builds_dense_per_row_sampling_tensors(tiny_model):
    """Each per-row field is a dense vector: the fused CUDA kernel reads element ``row`` of each, and
    strided column views of one [rows, 3] tensor gave it top-p/min-p values as temperatures."""
    engine = LLMEngine(tiny_model("llama"), EngineConfig(device="cpu", dtype="float32", max_model_len=64))
    runner: ModelRunner = engine.runner
    engine.generate(  # leaves the runner warm; then build tensors for three sequences by hand
        [[5, 6, 7]], SamplingParams(temperature=0.5, top_p=0.9, min_p=0.1, max_new_tokens=1, seed=0)
    )
    from tidal.rollout.scheduling.sequence import Sequence

    params = [
        SamplingParams(temperature=t, top_p=p, min_p=m, seed=0)
        for t, p, m in [(0.5, 0.9, 0.1), (1.5, 0.8, 0.0)]
    ]
    seqs = [Sequence(i, 0, 0, [5, 6], p, 1000 + i) for i, p in enumerate(params)]
    st = runner._build_sampling_tensors(seqs)
    for name in ("temperatures", "top_k", "top_p", "min_p", "seeds", "positions"):
        assert getattr(st, name).is_contiguous(), name
    assert st.temperatures.tolist() == [0.5, 1.5]
    assert st.top_p.tolist() == pytest.approx([0.9, 0.8]) and st.min_p.tolist() == pytest.approx([0.1, 0.0])


@pytest.fixture(scope="module")
def sharp_engine(tiny_model, hf_model):
    """A tiny model with peaked next-token distributions (like a trained one), its engine and HF model."""
    path = tiny_model("llama", logit_scale=8.0)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=256))
    return engine, hf_model(path)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=8, temperature=1.0),
        SamplingParams(n=4, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
    ],
    ids=["t1", "t0.7-truncated"],
)
def test_engine_samples_prefill_and_decode_tokens_from_the_hf_distribution(sharp_engine, params):
    """End to end on the CPU engine: first token (prefill) and second token (decode step) against the
    exact probabilities of a ``transformers`` forward of the same weights; n samples as diverse as
    independent draws."""
    engine, hf = sharp_engine
    report = check_engine_sampling(engine, hf, list(range(10, 40)), params, requests=4096 // params.n)
    assert report.first.outside_support == 0 and report.second.outside_support == 0, report
    assert report.worst_z() < Z_MAX, report.as_dict()
