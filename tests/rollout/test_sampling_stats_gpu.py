"""The CUDA sampling paths against exact probabilities and the plain reference (skipped without a GPU).

The fused Triton kernel must return, for the same seeds and positions, exactly the tokens of
``Sampler.reference`` on realistic shapes (152k and 300-token vocabularies, 1 to 1,024 rows, bf16 and
fp32 logits, peaked and flat distributions, every row, per-row settings as strided views); samples
must pass the chi-square and diversity checks of ``test_sampling_stats.py`` through the kernel and
through the whole CUDA engine (graphs on and off).
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout import EngineConfig, LLMEngine, SamplingParams
from tidal.rollout.runner.sampler import Sampler, SamplingTensors, sequence_seed
from tidal.testing.sampling_check import check_engine_sampling
from tidal.testing.stats import expected_distinct, goodness_of_fit, mean_z

pytestmark = pytest.mark.gpu
Z_MAX = 5.0


def _logits(rows: int, vocab: int, kind: str, dtype, gen) -> torch.Tensor:
    if kind == "peaked":  # a few dominant tokens per row, like a trained model's
        logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 2
        top = torch.randint(0, vocab, (rows, 8), device="cuda", generator=gen)
        logits.scatter_add_(1, top, torch.linspace(9, 2, 8, device="cuda").expand(rows, 8))
    else:  # nearly flat: many near-ties after bf16 rounding
        logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 0.05
    return logits.to(dtype)


def _row_settings(rows: int, gen):
    """Per-row settings as the engine used to build them: columns of one [rows, 3] tensor (strided)."""
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.05], device="cuda").repeat(rows // 5 + 1)[:rows]
    floats = torch.stack([temps, torch.full_like(temps, 0.9), torch.zeros_like(temps)], dim=1)
    ints = torch.stack(
        [
            torch.randint(0, 2**32, (rows,), device="cuda", generator=gen),
            torch.randint(0, 8192, (rows,), device="cuda", generator=gen),
        ],
        dim=1,
    )
    return floats[:, 0], ints[:, 0], ints[:, 1]  # all three strided


@pytest.mark.parametrize("vocab", [151936, 300])
@pytest.mark.parametrize("rows", [1, 7, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_fused_kernel_returns_the_reference_tokens_on_every_row(vocab, rows, dtype, kind):
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + vocab)
    logits = _logits(rows, vocab, kind, dtype, gen)
    temps, seeds, positions = _row_settings(rows, gen)
    assert not temps.is_contiguous() or rows == 1
    st = SamplingTensors(all_greedy=False, temperatures=temps, seeds=seeds, positions=positions)
    want_tokens, want_logprobs = Sampler.reference(logits, st)
    tokens, logprobs = Sampler(fused=True)(logits, st)
    mismatched = (tokens != want_tokens).nonzero().flatten().tolist()
    assert not mismatched, f"rows {mismatched[:10]} differ (of {rows})"
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-5, rtol=1e-5)
    greedy_tokens, _ = Sampler(fused=True)(logits, SamplingTensors(all_greedy=True))
    assert torch.equal(greedy_tokens, logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.5])
def test_fused_kernel_samples_follow_the_exact_distribution_at_152k(dtype, temperature):
    """65,536 draws of one peaked 152k-vocabulary row (8 samples per seeded request, as the engine
    seeds them): chi-square against softmax(logits / T) and the diversity of each request's samples."""
    vocab, rows, n = 151936, 65536, 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = _logits(1, vocab, "peaked", dtype, gen)[0]
    probs = (logits.double().cpu() / temperature).softmax(-1)
    sampler, tokens = Sampler(fused=True), []
    for start in range(0, rows, 4096):
        r = range(start, start + 4096)
        st = SamplingTensors(
            all_greedy=False,
            temperatures=torch.full((4096,), temperature, device="cuda"),
            seeds=torch.tensor([sequence_seed(i // n, i % n) for i in r], device="cuda"),
            positions=torch.full((4096,), 11, dtype=torch.int64, device="cuda"),
        )
        tokens.append(sampler(logits.expand(4096, vocab), st)[0].cpu())
    tokens = torch.cat(tokens)
    fit = goodness_of_fit(torch.bincount(tokens, minlength=vocab), probs)
    assert fit.z < Z_MAX, fit
    distinct = torch.tensor([len(set(g.tolist())) for g in tokens.view(-1, n)], dtype=torch.float64)
    assert abs(mean_z(distinct, expected_distinct(probs, n))) < Z_MAX


@pytest.fixture(scope="module")
def sharp(tiny_model, hf_model):
    path = tiny_model("llama", logit_scale=8.0)
    return path, hf_model(path).cuda()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=8, temperature=1.0),
        SamplingParams(n=8, temperature=0.7),
        SamplingParams(n=4, top_p=0.8),
    ],
    ids=["t1", "t0.7", "top_p"],
)
def test_cuda_engine_samples_from_the_hf_distribution(sharp, eager, params):
    """The whole CUDA engine (fused kernel for untruncated rows, cached per-row tensors advanced on
    device in decode, CUDA graphs) against a ``transformers`` forward of the same weights."""
    path, hf = sharp
    config = EngineConfig(device="cuda", dtype="float32", max_model_len=64, enforce_eager=eager)
    report = check_engine_sampling(
        LLMEngine(path, config), hf, list(range(10, 40)), params, 16384 // params.n
    )
    assert report.first.outside_support == 0 and report.second.outside_support == 0, report
    assert report.worst_z() < Z_MAX, report.as_dict()
