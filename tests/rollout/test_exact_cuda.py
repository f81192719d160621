"""``--exact_logprobs`` on CUDA: the batch-invariant Triton kernels (``tidal/rollout/kernels/triton_exact.py``) and the
engine-vs-trainer equality they give in bfloat16.

Two groups:

- ``gpu``: the compiled kernels at Qwen2-7B / 0.5B shapes (K=3584, 152k vocabulary rows, head_dim 128,
  GQA 28/4, up to 4k keys) against a float64 reference computed from the same (bf16) inputs, and their
  invariance: a row alone, inside 1..300 other rows, as a decode or a prefill query gives the same bits
  (``torch.equal``); then the engine's sampled-token log-probs on CUDA bf16 (and fp32) against the trainer's
  exact forward (a float32 master model under bf16 autocast, as ``tidal ppo`` runs it): max |diff| == 0,
  and the gap without the mode, printed (``test_exact_cuda_engine.py``).
- interpreter (``test_exact_interpreted.py``): the same kernels run by Triton's interpreter on CPU
  (``TRITON_INTERPRET=1``) at small float32 shapes, the batch-invariant ops dispatched to them (their
  gradients included), and the engine against the trainer with every exact op on the kernels; skipped
  where triton is not importable or CUDA is present.

Tolerances (bf16 vs float64 of the same bf16 inputs): the GEMM rounds its float32 sum once to bf16
(relative 2^-9) and float32 accumulation over K=3584 adds ~1e-6; RMSNorm rounds the normalised value and
the product with the weight (2 x 2^-9); attention rounds the probabilities to bf16 before P@V (at most
2^-9 of each term, so 2^-9 max|v| in all) and the output (2^-9); the log-softmax reads bf16 logits exactly
and reduces in float32 with approximate exp/log (~1e-6 relative to the log-sum-exp). Each bound below
is about 2x those.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tidal.rollout import batch_invariant as bi

TEMPERATURE = 0.8


# ------------------------------------------------------------------------------------ references
def ref_matmul(x, w):
    return x.double() @ w.double().T


def ref_rms_norm(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def ref_attention(q, k, v, q_pos, scale, window=None):
    """float64 causal attention, the definition: key j seen iff j <= q_pos (and within the window)."""
    groups = q.shape[2] // k.shape[2]
    k = k.double().repeat_interleave(groups, dim=2)
    v = v.double().repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    j = torch.arange(k.shape[1], device=q.device)
    seen = j[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        seen &= j[None, None, :] > q_pos[:, :, None] - window
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def ref_token_logprobs(logits, tokens, temperature):
    z = logits.double() / temperature.double()[..., None]
    return torch.log_softmax(z, -1).gather(-1, tokens[..., None]).squeeze(-1)


# ------------------------------------------------------------------------------------ gpu: kernels
def _gpu():
    from tidal.rollout.kernels import triton_exact

    return triton_exact


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("k", "n"), [(3584, 4608), (896, 151936), (896, 896), (896, 128), (4864, 896), (896, 4864)]
)
def test_matmul_matches_float64_and_each_row_is_its_own(dtype, k, n):
    """(0.5B's q/o, k/v, down, gate/up and lm_head shapes: each of ``matmul_config``'s tile choices.)"""
    te = _gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(301, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    full = te.matmul(x, w)
    assert full.dtype == dtype
    ref = ref_matmul(x, w)
    if dtype == torch.bfloat16:
        bound = 2**-8 * ref.abs() + 1e-4  # one bf16 rounding + float32 sums over K (~1e-5 at most)
    else:  # IEEE float32 products (not TF32), float32 sums
        bound = 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((full.double() - ref).abs() <= bound).all()
    for rows in (slice(0, 1), slice(7, 8), slice(300, 301), slice(3, 5), slice(0, 17), slice(1, 300)):
        assert torch.equal(te.matmul(x[rows], w), full[rows])
    # a packed projection's part (a view of the packed weight: the engine's) gives what the same rows as a
    # weight of their own (the trainer's separate layer) give; and the full product's columns where the
    # part's tiles are the full weight's (the tile width follows N: ``matmul_config``)
    lo, hi = n // 4, n // 2
    part = te.matmul(x[:9], w[lo:hi])
    assert torch.equal(part, te.matmul(x[:9], w[lo:hi].clone()))
    if te.matmul_config(hi - lo, k, x.element_size()) == te.matmul_config(n, k, x.element_size()):
        assert torch.equal(part, full[:9, lo:hi])
    if n <= 5000:  # a trainer's batch (16k rows) gives the rows the same bits
        assert torch.equal(te.matmul(x.repeat(55, 1), w)[-301:], full)
    # a bias in the epilogue: torch's separate add's bits (the product rounded, the sum in float32, rounded)
    bias = (torch.randn(n, device="cuda", generator=g) * 4).to(dtype)
    assert torch.equal(te.matmul(x, w, bias), full + bias)
    # a row's place in the batch does not matter either
    perm = torch.randperm(301, device="cuda", generator=g)
    assert torch.equal(te.matmul(x[perm], w), full[perm])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize(("k", "n"), [(896, 896), (896, 128), (4864, 896), (3584, 512), (18944, 3584)])
def test_split_matmul_gives_a_row_the_same_bits_in_parallel_or_in_turn(k, n, splits):
    """A K split in bf16 at the 0.5B / 7B shapes a decode step splits: the ranges in parallel programs (the
    engine's few rows) and in turn in one program (a trainer's 16k rows, ``PARALLEL_SPLIT_TILES``) give a
    row the same bits, bias included, whatever the row count; within one bf16 rounding of float64."""
    te = _gpu()
    g = torch.Generator(device="cuda").manual_seed(splits)
    x = torch.randn(301, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    bias = (torch.randn(n, device="cuda", generator=g) * 4).bfloat16()
    config = dataclasses.replace(te.matmul_config(n, k), splits=splits)
    ref = ref_matmul(x, w)
    in_turn = te.matmul(x, w, config=config, parallel_split=False)
    assert ((in_turn.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-4).all()
    assert torch.equal(te.matmul(x, w, config=config, parallel_split=True), in_turn)
    for rows in (slice(0, 1), slice(300, 301), slice(3, 5), slice(1, 300)):
        assert torch.equal(te.matmul(x[rows], w, config=config), in_turn[rows])
    assert torch.equal(te.matmul(x.repeat(55, 1), w, config=config)[-301:], in_turn)  # 16k rows: in turn
    assert torch.equal(te.matmul(x[:40], w, bias, config=config), in_turn[:40] + bias)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(1152, 896), (9728, 896), (896, 4864), (151936, 896), (37888, 3584)])
@pytest.mark.parametrize("tile", [(64, 64, 64, 4), (128, 128, 64, 8), (256, 64, 64, 8)])
def test_tma_launch_gives_the_pointer_launchs_bits(n, k, tile):
    """The engine's decode launches of the 0.5B / 7B shapes (packed q/k/v and gate/up, down, the LM head)
    with TMA loads give the pointer loads' bits, at 256 rows, 200 (a partial row tile) and 1, for a few
    tiles; and the trainer's launch's (the decode launch's verification, which takes a TMA launch only
    when it holds)."""
    te = _gpu()
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(256, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    bm, bn, bk, warps = tile
    tma = te.MatmulConfig(block_n=bn, num_warps=warps, num_stages=3, block_m=bm, block_k=bk, tma=1)
    pointers = dataclasses.replace(tma, tma=0)
    train = te.matmul(x, w, config=te.matmul_config(n, k))
    for rows in (slice(0, 256), slice(0, 200), slice(7, 8)):
        assert te.tma_loadable(x[rows]) and te.tma_loadable(w)  # so the launch below loads by TMA
        out = te.matmul(x[rows], w, config=tma)
        assert torch.equal(out, te.matmul(x[rows], w, config=pointers))
        assert torch.equal(out, train[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [896, 3584])
def test_rms_norm_matches_float64_and_each_row_is_its_own(hidden):
    te = _gpu()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(301, hidden, device="cuda", generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    full = te.rms_norm(x, w, 1e-6, False)
    ref = ref_rms_norm(x, w, 1e-6)
    assert ((full.double() - ref).abs() <= 2**-7 * ref.abs() + 1e-6).all()
    for rows in (slice(0, 1), slice(150, 151), slice(0, 2), slice(5, 301)):
        assert torch.equal(te.rms_norm(x[rows], w, 1e-6, False), full[rows])
    # through the op, with a float32 (master) weight: the weight is rounded to bf16 first, as the engine's
    assert torch.equal(bi.rms_norm(x, w.float(), 1e-6), full)
    # rows at an odd address (a view) sum in the same order
    odd = torch.empty(301 * hidden + 1, dtype=x.dtype, device="cuda")[1:].view(301, hidden)
    odd.copy_(x)
    assert torch.equal(te.rms_norm(odd, w, 1e-6, False), full)
    # the engine's add + norm launch: torch's rounded sum, and the norm of that sum row by row
    res = (torch.randn(301, hidden, device="cuda", generator=g) * 3).bfloat16()
    summed, total = te.rms_norm(x, w, 1e-6, False, res)
    assert torch.equal(total, x + res)
    assert torch.equal(summed, te.rms_norm(x + res, w, 1e-6, False))
    assert torch.equal(te.rms_norm(x[7:8], w, 1e-6, False, res[7:8])[0], summed[7:8])


@pytest.mark.gpu
def test_token_logprobs_match_float64_over_a_152k_vocabulary_and_each_row_is_its_own():
    te = _gpu()
    g = torch.Generator(device="cuda").manual_seed(2)
    vocab = 151936
    logits = (torch.randn(300, vocab, device="cuda", generator=g) * 4).bfloat16()
    tokens = torch.randint(0, vocab, (300,), device="cuda", generator=g)
    temps = torch.rand(300, device="cuda", generator=g) + 0.3
    full = te.token_logprobs(logits, tokens, temps)
    ref = ref_token_logprobs(logits, tokens, temps)
    assert (full.double() - ref).abs().max().item() < 1e-4
    for rows in (slice(0, 1), slice(299, 300), slice(10, 12), slice(1, 300)):
        assert torch.equal(te.token_logprobs(logits[rows], tokens[rows], temps[rows]), full[rows])
    odd = torch.empty(8 * vocab + 1, dtype=logits.dtype, device="cuda")[1:].view(8, vocab)
    odd.copy_(logits[:8])
    assert torch.equal(te.token_logprobs(odd, tokens[:8], temps[:8]), full[:8])
    # through the op: [B, T, V] rows and a scalar temperature
    lp = bi.token_logprobs(logits.view(3, 100, vocab), tokens.view(3, 100), TEMPERATURE)
    alone = bi.token_logprobs(logits[150:151], tokens[150:151], TEMPERATURE)
    assert torch.equal(lp.view(-1)[150:151], alone)


def _attention_inputs(b, lq, lk, heads=28, kv=4, d=128, seed=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, lq, heads, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, lk, kv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, lk, kv, d, device="cuda", generator=g).bfloat16()
    return q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1000])
def test_attention_matches_float64_at_4k_keys_with_gqa(window):
    te = _gpu()
    q, k, v = _attention_inputs(2, 4096, 4096)
    scale = 128**-0.5
    pos = torch.arange(4096, device="cuda").expand(2, 4096)
    out = te.attention(q, k, v, pos, scale, window)
    pick = torch.tensor([0, 1, 63, 64, 65, 999, 1000, 2047, 3000, 4095], device="cuda")
    ref = ref_attention(q[:, pick], k, v, pos[:, pick], scale, window)
    bound = 2**-8 * ref.abs() + 2**-8 * v.abs().max().item()
    assert ((out[:, pick].double() - ref).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100])
def test_attention_query_alone_in_a_batch_as_decode_or_prefill_gives_the_same_bits(window):
    te = _gpu()
    scale = 128**-0.5
    q, k, v = _attention_inputs(5, 700, 700)
    g = torch.Generator(device="cuda").manual_seed(4)
    pos = torch.arange(700, device="cuda").expand(5, 700)
    prefill = te.attention(q, k, v, pos, scale, window)
    for b, p in ((0, 0), (1, 63), (2, 64), (3, 401), (4, 699)):
        # decode: one query against the sequence's keys up to it (the rest of a block garbage)
        keys = -(-(p + 1) // 16) * 16
        k_junk, v_junk = k[b : b + 1, :keys].clone(), v[b : b + 1, :keys].clone()
        k_junk[:, p + 1 :], v_junk[:, p + 1 :] = 30.0, -7.0
        decode = te.attention(
            q[b : b + 1, p : p + 1], k_junk, v_junk, pos[b : b + 1, p : p + 1], scale, window
        )
        assert torch.equal(decode, prefill[b : b + 1, p : p + 1])
        # the same query inside a batch of 300 decode rows of other sequences (a paged-cache width of 720)
        rows = torch.randint(0, 5, (300,), device="cuda", generator=g)
        rows[137] = b
        qpos = torch.randint(0, 700, (300, 1), device="cuda", generator=g)
        qpos[137] = p
        kw = torch.nn.functional.pad(k[rows], (0, 0, 0, 0, 0, 20))
        vw = torch.nn.functional.pad(v[rows], (0, 0, 0, 0, 0, 20))
        batch = te.attention(q[rows, qpos[:, 0]][:, None], kw, vw, qpos, scale, window)
        assert torch.equal(batch[137:138], prefill[b : b + 1, p : p + 1])
    # a prefill of a shorter prompt (the same first 300 tokens) agrees on those tokens
    short = te.attention(q[:, :300], k[:, :300], v[:, :300], pos[:, :300], scale, window)
    assert torch.equal(short, prefill[:, :300])
    # chunked prefill: queries [300, 700) against all keys
    chunk = te.attention(q[:, 300:], k, v, pos[:, 300:], scale, window)
    assert torch.equal(chunk, prefill[:, 300:])


@pytest.mark.gpu
def test_attention_float32_matches_float64():
    te = _gpu()
    q, k, v = (t.float() for t in _attention_inputs(2, 300, 300, heads=8, kv=2, d=64))
    pos = torch.arange(300, device="cuda").expand(2, 300)
    out = te.attention(q, k, v, pos, 0.125)
    assert (out.double() - ref_attention(q, k, v, pos, 0.125)).abs().max().item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100])
def test_paged_attention_gives_the_gathered_bits_at_the_05b_shape(window):
    """The engine's decode and context-prefill path (``paged_attention``: keys read through the block
    table) against ``attention`` over the gathered table width: Qwen2.5-0.5B's heads (14/2, d 64), 16-slot
    pages in shuffled order, a 2k-key table width, junk in unreferenced blocks."""
    te = _gpu()
    g = torch.Generator(device="cuda").manual_seed(5)
    page, width, rows = 16, 128, 6
    cache = torch.randn(2, rows * width + 7, page, 2, 64, device="cuda", generator=g).bfloat16()
    tables = torch.randperm(cache.shape[1], device="cuda", generator=g)[: rows * width].view(rows, width)
    tables = tables.to(torch.int32)
    gathered = cache.flatten(2).index_select(1, tables.view(-1).long()).view(2, rows, width * page, 2, 64)
    decode_pos = torch.tensor([[0], [63], [64], [700], [2000], [2047]], device="cuda")
    prefill_pos = torch.tensor([[0], [60], [500], [1000], [1500], [1900]], device="cuda")
    prefill_pos = prefill_pos + torch.arange(100, device="cuda")
    for pos in (decode_pos, prefill_pos):
        q = torch.randn(rows, pos.shape[1], 14, 64, device="cuda", generator=g).bfloat16()
        paged = te.paged_attention(q, cache, tables, pos, 0.125, window)
        assert torch.equal(paged, te.attention(q, gathered[0], gathered[1], pos, 0.125, window))


@pytest.mark.gpu
def test_exact_ops_capture_in_a_cuda_graph():
    """The engine captures decode steps in CUDA graphs: the kernels need no host sync."""
    te = _gpu()
    q, k, v = _attention_inputs(4, 1, 256)
    pos = torch.tensor([[0], [100], [255], [17]], device="cuda")
    w = torch.randn(640, 128 * 28, device="cuda").bfloat16()
    eager = te.matmul(te.attention(q, k, v, pos, 0.1).view(4, -1), w)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        te.matmul(te.attention(q, k, v, pos, 0.1).view(4, -1), w)  # compile outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = te.matmul(te.attention(q, k, v, pos, 0.1).view(4, -1), w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
