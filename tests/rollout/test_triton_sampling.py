"""The split-vocabulary sampling kernels (``tidal/rollout/kernels/triton_sampling.py``) against the one-program-per-row
kernel (``fused_sample(..., chunks=1)``) and the torch ``Sampler.reference``.

The contract: the split kernels draw bit-identical tokens to the one-program kernel for every input (same
hash noise, first index of the best score), and log-probs that differ only by the order of the float32
sum of exponentials (1e-5 here).

- interpreter: the kernels run by Triton's interpreter on CPU (``TRITON_INTERPRET=1``) at small shapes
  with small blocks (so a row spans several chunks, the last one short): random logits with greedy and
  sampled rows, ties across chunks, rows of -inf, float32 and bfloat16 logits. The interpreter has no
  libdevice: its ``log`` is numpy's float32 log there (the same in both kernels, so tokens still compare
  exactly; against torch's CPU log the sampled tokens agree on these inputs, log-probs to 1e-5).
- ``gpu``: the compiled kernels at 64 and 256 rows of a 152k vocabulary (bf16 and fp32), inside a CUDA
  graph replayed on new logits, and a chi-square of the split kernel's samples against softmax(logits/T).
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.triton_interpreter import NumpyLibdevice, interpreted
from tidal.accel import DEFAULT_SMS, sm_count
from tidal.rollout.runner.sampler import Sampler, SamplingTensors, sequence_seed
from tidal.testing.stats import expected_distinct, goodness_of_fit, mean_z

TEMPERATURES = [0.0, 0.7, 1.0, 1.3]


def row_settings(rows: int, device, gen):
    """Temperatures cycling through greedy (0), 0.7, 1.0 and 1.3; random seeds and positions."""
    temps = torch.tensor(TEMPERATURES * (rows // 4 + 1), device=device)[:rows]
    seeds = torch.randint(0, 2**32, (rows,), device=device, generator=gen)
    positions = torch.randint(0, 8192, (rows,), device=device, generator=gen)
    return temps, seeds, positions


def assert_same_draws(ts, logits, temps, seeds, positions, **split):
    """Split (``split``: chunks/block) and one-program kernels: equal tokens, close log-probs; greedy too.
    Returns the sampled (tokens, log-probs)."""
    ref_tokens, ref_logprobs = ts.fused_sample(logits, temps, seeds, positions, chunks=1)
    tokens, logprobs = ts.fused_sample(logits, temps, seeds, positions, **split)
    mismatched = (tokens != ref_tokens).nonzero().flatten().tolist()
    assert not mismatched, f"rows {mismatched[:10]} differ (of {len(tokens)})"
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1.3e-6, equal_nan=True)
    greedy_ref = ts.fused_sample(logits, None, None, None, chunks=1)
    greedy = ts.fused_sample(logits, None, None, None, **split)
    assert torch.equal(greedy[0], greedy_ref[0])
    torch.testing.assert_close(greedy[1], greedy_ref[1], atol=1e-5, rtol=1.3e-6, equal_nan=True)
    # without log-probs (exact mode's pass, which takes its own): the same tokens, none computed
    for kwargs in (dict(chunks=1), split):
        alone = ts.fused_sample(logits, temps, seeds, positions, logprobs=False, **kwargs)
        assert alone[1] is None and torch.equal(alone[0], tokens)
    assert torch.equal(ts.fused_sample(logits, None, None, None, logprobs=False, **split)[0], greedy[0])
    return tokens, logprobs


# ------------------------------------------------------------------------------------ interpreter


@pytest.fixture(scope="module")
def ts():
    """``triton_sampling`` run by Triton's interpreter."""
    kernels = {"tidal.rollout.kernels.triton_sampling": "_sample_kernel"}
    with interpreted(kernels) as (module,), pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "libdevice", NumpyLibdevice)
        yield module


@pytest.mark.parametrize(
    "rows, vocab, dtype, split",
    [
        (8, 5000, torch.float32, dict(block=256)),  # split_chunks: 4 chunks of 1280, the last 1160
        (3, 40_000, torch.bfloat16, dict(chunks=5, block=1024)),  # 5 chunks of 8192, the last 7232
        (5, 3001, torch.float32, dict(chunks=3, block=128)),  # 3 chunks of 1024, the last 953
    ],
)
def test_split_kernel_draws_the_one_program_tokens_interpreted(ts, rows, vocab, dtype, split):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temps, seeds, positions = row_settings(rows, "cpu", gen)
    tokens, logprobs = assert_same_draws(ts, logits, temps, seeds, positions, **split)
    st = SamplingTensors(all_greedy=False, temperatures=temps, seeds=seeds, positions=positions)
    want_tokens, want_logprobs = Sampler.reference(logits, st)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=1.3e-6)
    if "chunks" not in split:  # the automatic count did split these rows
        assert ts.split_chunks(rows, vocab, DEFAULT_SMS, split["block"]) > 1


def test_ties_go_to_the_lowest_index_across_chunks_interpreted(ts):
    """Greedy rows (and sampled rows of equal logits, whose winner is the noise's) with the maximum at
    several indices: at the last element of one chunk and the first of the next, in two lanes of one
    chunk, in every element; 4 chunks of 256."""
    vocab, chunk = 1000, 256
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [chunk - 1, chunk, 3 * chunk + 5]] = 9.0  # boundary of chunks 0 and 1: index 255
    logits[1, [2 * chunk + 7, 2 * chunk + 7 + 128, 3 * chunk]] = 9.0  # lanes 7 of two blocks of chunk 2
    logits[2] = 0.0  # all equal: greedy takes index 0
    logits[3, [999, 500]] = 9.0  # the short last chunk against an earlier one
    logits[4:] = 1.5  # sampled rows of equal logits
    temps = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.7])
    seeds, positions = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 1, 2, 3, 4, 5])
    tokens, _ = assert_same_draws(ts, logits, temps, seeds, positions, chunks=4, block=128)
    assert tokens[:4].tolist() == [chunk - 1, 2 * chunk + 7, 0, 500]
    st = SamplingTensors(all_greedy=False, temperatures=temps, seeds=seeds, positions=positions)
    assert torch.equal(tokens, Sampler.reference(logits, st)[0])


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy's log(0), -inf - -inf
def test_rows_of_minus_inf_interpreted(ts):
    """-inf entries (masked vocabulary): whole chunks of -inf, a single finite token, an all -inf row
    (token 0 and a nan log-prob, as the one-program kernel and torch give)."""
    vocab = 2000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, :1500] = float("-inf")  # chunks 0-2 all -inf
    logits[1, :] = float("-inf")
    logits[1, 1234] = 2.0
    logits[2, ::3] = float("-inf")
    logits[3, :] = float("-inf")
    _, seeds, positions = row_settings(4, "cpu", torch.Generator().manual_seed(2))
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0])
    tokens, logprobs = assert_same_draws(ts, logits, temps, seeds, positions, chunks=4, block=128)
    assert tokens[1].item() == 1234 and logprobs[1].item() == 0.0
    assert tokens[0].item() >= 1500 and tokens[3].item() == 0 and logprobs[3].isnan()
    assert torch.isfinite(logprobs[:3]).all()
    st = SamplingTensors(all_greedy=False, temperatures=temps, seeds=seeds, positions=positions)
    assert torch.equal(tokens, Sampler.reference(logits, st)[0])


def test_no_rows_interpreted(ts):
    tokens, logprobs = ts.fused_sample(torch.zeros(0, 100), None, None, None)
    assert tokens.shape == (0,) and logprobs.shape == (0,)


def test_chunk_count_fills_the_gpu():
    """Powers of two up to PROGRAMS_PER_SM programs per SM, chunks of at least MIN_BLOCKS_PER_CHUNK
    blocks; one chunk (the one-program kernel) for small vocabularies and batches that fill the GPU."""
    ts = pytest.importorskip("tidal.rollout.kernels.triton_sampling", exc_type=ImportError)
    vocab, sms, block = 151936, 132, 512
    assert ts.split_chunks(64, vocab, sms, block) == 32
    assert ts.split_chunks(256, vocab, sms, block) == 8
    assert ts.split_chunks(1024, vocab, sms, block) == 2
    assert ts.split_chunks(4096, vocab, sms, block) == 1
    assert ts.split_chunks(1, vocab, sms, block) == 64  # not 128: 151936 / 128 < 4 blocks
    assert ts.split_chunks(64, 300, sms, block) == 1
    for rows in (1, 3, 64, 200, 256, 1000):
        chunks = ts.split_chunks(rows, vocab, sms, block)
        assert chunks & (chunks - 1) == 0 and vocab // chunks >= ts.MIN_BLOCKS_PER_CHUNK * block
        assert rows * chunks >= ts.PROGRAMS_PER_SM * sms or vocab // (2 * chunks) < 4 * block


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [64, 256])
def test_split_kernel_draws_the_one_program_tokens_at_152k(rows, dtype):
    from tidal.rollout.kernels import triton_sampling as ts

    vocab = 151936
    assert ts.split_chunks(rows, vocab, sm_count(torch.device("cuda"))) > 1
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for scale in (4.0, 0.05):  # spread and nearly flat (many near-ties after bf16 rounding)
        logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * scale).to(dtype)
        temps, seeds, positions = row_settings(rows, "cuda", gen)
        tokens, logprobs = assert_same_draws(ts, logits, temps, seeds, positions)
        st = SamplingTensors(all_greedy=False, temperatures=temps, seeds=seeds, positions=positions)
        want_tokens, want_logprobs = Sampler.reference(logits, st)
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logprobs, want_logprobs, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
def test_split_kernel_replays_in_a_cuda_graph():
    """Decode captures the sampler: a replay on new logits gives those logits' draws (scratch buffers
    allocated inside the capture come from the graph's pool)."""
    from tidal.rollout.kernels import triton_sampling as ts

    rows, vocab = 64, 151936
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).bfloat16()
    temps, seeds, positions = row_settings(rows, "cuda", gen)
    ts.fused_sample(logits, temps, seeds, positions)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tokens, logprobs = ts.fused_sample(logits, temps, seeds, positions)
    torch.cuda.current_stream().wait_stream(stream)
    logits.copy_(torch.randn(rows, vocab, device="cuda", generator=gen) * 3)
    positions.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    want_tokens, want_logprobs = ts.fused_sample(logits, temps, seeds, positions)
    assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs)
    assert torch.equal(tokens, ts.fused_sample(logits, temps, seeds, positions, chunks=1)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_split_kernel_samples_follow_the_exact_distribution_at_152k(temperature):
    """65,536 draws of one peaked 152k-vocabulary row through the split kernel (256 rows a call: 8
    chunks a row; 8 samples per seeded request, as the engine seeds them): chi-square against
    softmax(logits / T) and the diversity of each request's samples."""
    from tidal.rollout.kernels import triton_sampling as ts

    vocab, draws, rows, n = 151936, 65536, 256, 8
    assert ts.split_chunks(rows, vocab, sm_count(torch.device("cuda"))) > 1
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(vocab, device="cuda", generator=gen) * 2
    top = torch.randint(0, vocab, (8,), device="cuda", generator=gen)
    logits = logits.index_add(0, top, torch.linspace(9, 2, 8, device="cuda")).bfloat16()
    probs = (logits.double().cpu() / temperature).softmax(-1)
    seeds = torch.tensor([sequence_seed(i // n, i % n) for i in range(draws)], device="cuda")
    temps = torch.full((rows,), temperature, device="cuda")
    positions = torch.full((rows,), 11, dtype=torch.int64, device="cuda")
    batch = logits.expand(rows, vocab)
    tokens = torch.cat(
        [ts.fused_sample(batch, temps, seeds[i : i + rows], positions)[0] for i in range(0, draws, rows)]
    ).cpu()
    fit = goodness_of_fit(torch.bincount(tokens, minlength=vocab), probs)
    assert fit.outside_support == 0 and fit.z < 5.0, fit
    distinct = torch.tensor([len(set(g.tolist())) for g in tokens.view(-1, n)], dtype=torch.float64)
    assert abs(mean_z(distinct, expected_distinct(probs, n))) < 5.0
