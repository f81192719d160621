"""``--exact_logprobs``'s batch-invariant Triton kernels (``tidal/rollout/kernels/triton_exact.py``) run by
Triton's interpreter on the CPU (``TRITON_INTERPRET=1``) at small float32 shapes: against float64
references (those of ``test_exact_cuda.py``), row invariance, the batch-invariant ops dispatched to them
(their gradients included), and the engine against the trainer with every exact op on the kernels;
skipped where triton is not importable or CUDA is present. Split from ``test_exact_cuda.py``.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from tests.rollout.test_exact_cuda import (
    TEMPERATURE,
    ref_attention,
    ref_matmul,
    ref_rms_norm,
    ref_token_logprobs,
)
from tests.rollout.test_exact_cuda_engine import _trainer_gaps
from tests.rollout.triton_interpreter import EXACT_KERNELS, interpreted
from tidal.rollout import batch_invariant as bi


@pytest.fixture(scope="module")
def te():
    """``tidal.rollout.kernels.triton_exact`` with its kernels run by Triton's interpreter."""
    with interpreted(EXACT_KERNELS) as (*_, module):
        yield module


@pytest.fixture
def on_kernels(te, monkeypatch):
    """Every batch-invariant op on CPU tensors through the (interpreted) kernels."""
    monkeypatch.setattr(bi.dispatch, "on_triton", lambda x: True)
    return te


def test_interpreted_matmul_rms_norm_and_logprobs_match_float64_and_are_row_invariant(te):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 100, generator=g), torch.randn(130, 100, generator=g)
    full = te.matmul(x, w)
    assert ((full.double() - ref_matmul(x, w)).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all()
    for rows in (slice(0, 1), slice(64, 65), slice(3, 40), slice(60, 70)):
        assert torch.equal(te.matmul(x[rows], w), full[rows])
    assert torch.equal(te.matmul(x[:5], w[64:100]), full[:5, 64:100])

    x3, wn = torch.randn(4, 3, 1100, generator=g), torch.randn(1100, generator=g)
    norm = te.rms_norm(x3, wn, 1e-6, False)
    assert (norm.double() - ref_rms_norm(x3, wn, 1e-6)).abs().max().item() < 1e-5
    assert torch.equal(te.rms_norm(x3[2, 1:2], wn, 1e-6, False), norm[2, 1:2])
    # the residual add in the norm's launch: the sum as torch's add gives it, and the norm of that sum
    res = torch.randn(4, 3, 1100, generator=g)
    summed, total = te.rms_norm(x3, wn, 1e-6, False, res)
    assert torch.equal(total, x3 + res) and torch.equal(summed, te.rms_norm(x3 + res, wn, 1e-6, False))

    logits, tokens = torch.randn(6, 5000, generator=g) * 4, torch.randint(0, 5000, (6,), generator=g)
    temps = torch.rand(6, generator=g) + 0.3
    lp = te.token_logprobs(logits, tokens, temps)
    assert (lp.double() - ref_token_logprobs(logits, tokens, temps)).abs().max().item() < 1e-5
    assert torch.equal(te.token_logprobs(logits[4:5], tokens[4:5], temps[4:5]), lp[4:5])


def test_matmul_config_is_a_function_of_the_weights_shape_at_the_05b_shapes(te, monkeypatch):
    """Qwen2.5-0.5B's weights (hidden 896, k/v 128, intermediate 4864, vocabulary 151936): by the rule,
    narrow weights get 64-column tiles, a long reduction one more stage; a shape measured on a GPU
    (``exact_gemm_tuned.TUNED``) takes its launches from the table, the K partition from ``K_SPLITS``
    (the same for the train and decode launch, and for every weight of that K); the row count is not an
    argument at all."""
    import inspect

    assert list(inspect.signature(te.matmul_config).parameters) == ["n", "k", "itemsize"]
    assert list(inspect.signature(te.decode_config).parameters) == ["n", "k", "itemsize"]
    for (n, k), entry in te.TUNED.items():  # each measured entry is a whole launch, its K step divides 128
        assert set(entry) <= {"train", "decode"} and entry
        for regime, pick in (("train", te.matmul_config), ("decode", te.decode_config)):
            if regime in entry:
                want = te.MatmulConfig(**entry[regime], splits=te.K_SPLITS.get(k, 1))
                assert pick(n, k) == want and te.SPLIT_ALIGN % entry[regime]["block_k"] == 0
                assert pick(n, k, itemsize=4) != want or want.splits == 1  # float32: the rule
        assert te.decode_config(n, k).k_split(k) == te.matmul_config(n, k).k_split(k)
    monkeypatch.setattr(te, "TUNED", {})
    monkeypatch.setattr(te, "K_SPLITS", {})
    assert te.matmul_config(896, 896).block_n == te.matmul_config(128, 896).block_n == 64
    assert te.matmul_config(896, 4864) == te.MatmulConfig(block_n=64, num_warps=4, num_stages=4)
    assert te.matmul_config(4864, 896).block_n == te.matmul_config(151936, 896).block_n == 128
    assert te.decode_config(896, 896) == te.matmul_config(896, 896)  # no decode launch listed: the train one
    monkeypatch.setattr(
        te,
        "TUNED",
        {(896, 896): {"train": {"block_n": 32, "num_warps": 4, "num_stages": 5, "block_m": 128}, "decode": {
            "block_n": 64, "num_warps": 4, "num_stages": 3}}},
    )  # fmt: skip
    monkeypatch.setattr(te, "K_SPLITS", {896: 4})
    assert te.matmul_config(896, 896) == te.MatmulConfig(
        block_n=32, num_warps=4, num_stages=5, block_m=128, splits=4
    )
    assert te.decode_config(896, 896) == te.MatmulConfig(block_n=64, num_warps=4, num_stages=3, splits=4)
    assert te.matmul_config(128, 896).splits == 4 and te.matmul_config(896, 4864).splits == 1  # per K
    assert te.matmul_config(896, 896, itemsize=4).block_n == 64  # float32 inputs: the rule's (shared memory)
    assert te.matmul_config(896, 896, itemsize=4).splits == 1


def test_interpreted_decode_launch_is_taken_only_where_verified(te, monkeypatch):
    """``verify_decode_launch``: a decode launch cutting K as the trainer's launches do (here: another tile
    over packed parts; numpy's products, unlike the GPU's MMAs, depend on the K step) gives their bits and is then taken for a decode step's rows by ``matmul`` and
    by ``linear_parts`` as one packed launch, equal to the parts apart; one cutting K otherwise (another
    split count) is refused, and ``matmul`` keeps the trainer's launch for that shape."""
    from tidal.rollout.batch_invariant import matmul as bi_matmul

    monkeypatch.setattr(te, "_VERIFIED", set())
    train = te.MatmulConfig(block_n=32, num_warps=4, num_stages=3, block_m=16, block_k=32, splits=2)
    decode = te.MatmulConfig(block_n=16, num_warps=4, num_stages=3, block_m=32, block_k=32, splits=2)
    parts = [48, 16, 16]
    # float32 (the interpreter's) takes the rule, not the table: set the two launches directly
    monkeypatch.setattr(te, "matmul_config", lambda n, k, itemsize=2: train)
    monkeypatch.setattr(te, "decode_config", lambda n, k, itemsize=2: decode)
    cpu = torch.device("cpu")
    assert te.verify_decode_launch(80, 300, torch.float32, cpu, parts)
    assert te.decode_launch_verified(torch.empty(80, 300), torch.float32)
    g = torch.Generator().manual_seed(7)
    x, w, bias = (
        torch.randn(5, 300, generator=g),
        torch.randn(80, 300, generator=g),
        torch.randn(80, generator=g),
    )
    apart = torch.cat([te.matmul(x, w[a:b], bias[a:b]) for a, b in ((0, 48), (48, 64), (64, 80))], dim=1)
    monkeypatch.setattr(bi.dispatch, "on_triton", lambda t: True)
    with torch.no_grad():
        assert torch.equal(bi_matmul.linear_parts(x, w, bias, parts), apart)
    launches = []
    real = te._matmul_kernel
    monkeypatch.setattr(te, "_matmul_kernel", _Recording(real, launches))
    with torch.no_grad():
        bi_matmul.linear_parts(x, w, bias, parts)
    assert launches == [16]  # one launch, the decode tile's block_n

    monkeypatch.setattr(te, "_VERIFIED", set())
    monkeypatch.setattr(te, "decode_config", lambda n, k, itemsize=2: dataclasses.replace(decode, splits=3))
    assert not te.verify_decode_launch(80, 300, torch.float32, cpu, parts)
    launches.clear()
    te.matmul(x, w)
    assert launches == [32]  # the trainer's launch


class _Recording:
    """A kernel stand-in recording each launch's ``field`` (a keyword argument) before running the real one."""

    def __init__(self, kernel, launches, field: str = "BLOCK_N"):
        self.kernel, self.launches, self.field = kernel, launches, field

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs[self.field])
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize(("n", "k"), [(48, 40), (130, 100), (1100, 100)])
def test_interpreted_matmul_gives_a_row_the_same_bits_whatever_the_row_count(te, n, k):
    """Each tile width of ``matmul_config`` (0.5B's k/v_proj, q/o_proj and down_proj, gate/up and lm_head,
    scaled down; the stage count, which the interpreter ignores, is covered by the gpu test): a row alone,
    among a few rows, at the end of a partial tile, and among 200 rows gives the same bits."""
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(200, k, generator=g), torch.randn(n, k, generator=g)
    full = te.matmul(x, w)
    assert ((full.double() - ref_matmul(x, w)).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all()
    for rows in (slice(0, 1), slice(199, 200), slice(5, 8), slice(60, 130)):
        assert torch.equal(te.matmul(x[rows], w), full[rows])


def _operands(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded ``x [rows, 300]``, ``w [70, 300]`` and a bias ``[70]``: several row, column and K tiles."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 300, generator=g),
        torch.randn(70, 300, generator=g),
        torch.randn(70, generator=g),
    )


@pytest.mark.parametrize("group_m", [1, 3])
def test_interpreted_launch_of_other_tiles_keeps_a_row_s_bits(te, group_m):
    """A launch other than the rule's (16x32 tiles, K in 32-column steps: several row tiles, N tiles and K
    steps at these shapes, masked edges; row tiles grouped by ``group_m`` for L2): float64's value within
    float32 sums, a row's bits whatever the row count, the grouping changing nothing, and the bias epilogue
    giving ``matmul + bias``'s bits."""
    config = te.MatmulConfig(block_n=32, num_warps=4, num_stages=3, block_m=16, block_k=32, group_m=group_m)
    x, w, bias = _operands(group_m, rows=90)
    full = te.matmul(x, w, config=config)
    assert ((full.double() - ref_matmul(x, w)).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all()
    for rows in (slice(0, 1), slice(89, 90), slice(5, 40)):
        assert torch.equal(te.matmul(x[rows], w, config=config), full[rows])
    assert torch.equal(te.matmul(x, w, config=dataclasses.replace(config, group_m=8)), full)
    assert torch.equal(te.matmul(x, w, bias, config=config), full + bias)


@pytest.mark.parametrize("splits", [2, 3])
def test_interpreted_split_launch_gives_the_same_bits_in_parallel_or_in_turn(te, splits):
    """A K split (block-aligned ranges, the last one shorter): the ranges in parallel programs plus the
    split sum, and the ranges in turn in one program, give the same bits (a row's and the whole output's,
    bias included), whatever the row count; the split changes the reduction order, so it differs from the
    unsplit launch somewhere (the comparison can fail) while staying within float32 sums of float64."""
    config = te.MatmulConfig(block_n=32, num_warps=4, num_stages=3, block_m=16, block_k=32, splits=splits)
    x, w, bias = _operands(splits, rows=40)
    assert config.k_split(300) % 32 == 0 and -(-300 // config.k_split(300)) == splits
    parallel = te.matmul(x, w, bias, config=config, parallel_split=True)
    in_turn = te.matmul(x, w, bias, config=config, parallel_split=False)
    assert torch.equal(parallel, in_turn)
    for rows in (slice(0, 1), slice(39, 40), slice(5, 30)):
        assert torch.equal(te.matmul(x[rows], w, bias, config=config, parallel_split=True), in_turn[rows])
        assert torch.equal(te.matmul(x[rows], w, bias, config=config, parallel_split=False), in_turn[rows])
    plain = te.matmul(x, w, config=config, parallel_split=False)
    assert ((plain.double() - ref_matmul(x, w)).abs() <= 1e-5 * (x.abs() @ w.abs().T)).all()
    assert not torch.equal(plain, te.matmul(x, w, config=dataclasses.replace(config, splits=1)))


@pytest.mark.parametrize("splits", [1, 3])
def test_interpreted_tma_launch_gives_the_pointer_launchs_bits(te, monkeypatch, splits):
    """``tma=1``: the tiles loaded through tensor descriptors, whose out-of-bounds rows, columns and K tail
    must read as zeros (40 rows, 70 columns, K = 300: partial tiles on all three): within float32 sums of
    float64, a row alone gets its bits in the whole output, split or not, and a view the copy engine cannot
    load (rows not 16-byte aligned) takes the pointer loads. (Bit-equality with the pointer loads is the GPU's
    to show, ``verify_decode_launch`` checks it there: numpy's product of the transposed weight tile sums
    in another order.)"""
    monkeypatch.setattr(te, "tma_loadable", lambda t: t.stride(1) == 1 and t.stride(0) % 4 == 0)
    tma = te.MatmulConfig(block_n=32, num_warps=4, num_stages=3, block_m=16, block_k=32, splits=splits, tma=1)
    pointers = dataclasses.replace(tma, tma=0)
    x, w, bias = _operands(splits, rows=40)
    launches = []
    real = te._matmul_kernel
    monkeypatch.setattr(te, "_matmul_kernel", _Recording(real, launches, "TMA"))
    full = te.matmul(x, w, bias, config=tma)
    assert launches[-1]
    assert (
        (full.double() - ref_matmul(x, w) - bias.double()).abs() <= 1e-5 * (x.abs() @ w.abs().T + 1)
    ).all()
    assert torch.equal(te.matmul(x[7:8], w, bias, config=tma, parallel_split=False), full[7:8])
    odd = torch.empty(40, 301)[:, :300]
    odd.copy_(x)
    unaligned = te.matmul(odd, w, bias, config=tma)
    assert not launches[-1] and torch.equal(unaligned, te.matmul(x, w, bias, config=pointers))


def test_interpreted_matmul_bias_in_the_epilogue_gives_the_separate_adds_bits(te):
    """``matmul(x, w, bias)`` == ``matmul(x, w) + bias`` bit for bit, and ``linear`` takes the epilogue where
    no gradient is wanted. float32 only: the interpreter's bf16 products and roundings are not the GPU's
    (``test_exact_cuda.py`` checks the bf16 rounding of the sum on the GPU)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(70, 100, generator=g), torch.randn(130, 100, generator=g)
    bias = torch.randn(130, generator=g) * 4
    fused = te.matmul(x, w, bias)
    assert torch.equal(fused, te.matmul(x, w) + bias)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(bi.dispatch, "on_triton", lambda t: True)
        assert torch.equal(bi.linear(x.view(7, 10, 100), w, bias), fused.view(7, 10, 130))


def test_interpreted_packed_parts_write_their_own_columns(on_kernels):
    """``linear_parts`` (the engine's q/k/v): each part's GEMM writes its columns of one output, the bits
    of the part as a layer of its own (the trainer's)."""
    g = torch.Generator().manual_seed(5)
    x, w, bias = (
        torch.randn(5, 3, 32, generator=g),
        torch.randn(80, 32, generator=g),
        torch.randn(80, generator=g),
    )
    sizes, bounds = [48, 16, 16], [(0, 48), (48, 64), (64, 80)]
    with torch.no_grad():
        packed = bi.linear_parts(x, w, bias, sizes)
        separate = [bi.linear(x, w[a:b].clone(), bias[a:b].clone()) for a, b in bounds]
    assert torch.equal(packed, torch.cat(separate, dim=-1))


@pytest.mark.parametrize(("window", "heads", "kv_heads"), [(None, 4, 2), (10, 4, 2), (None, 7, 1)])
def test_interpreted_attention_matches_float64_and_a_query_alone_gives_the_same_bits(
    te, window, heads, kv_heads
):
    """(GQA 7/1: a tile of 32 (query, head) rows ends inside a query's group of heads.)"""
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, 40, heads, 16, generator=g),
        torch.randn(2, 40, kv_heads, 16, generator=g),
        torch.randn(2, 40, kv_heads, 16, generator=g),
    )
    pos = torch.arange(40).expand(2, 40)
    full = te.attention(q, k, v, pos, 0.3, window)
    assert (full.double() - ref_attention(q, k, v, pos, 0.3, window)).abs().max().item() < 1e-5
    for b, p in ((0, 0), (1, 13), (0, 31), (1, 32), (1, 39)):
        junk_k, junk_v = k[b : b + 1].clone(), v[b : b + 1].clone()
        junk_k[:, p + 1 :], junk_v[:, p + 1 :] = 50.0, -9.0
        alone = te.attention(q[b : b + 1, p : p + 1], junk_k, junk_v, pos[b : b + 1, p : p + 1], 0.3, window)
        assert torch.equal(alone, full[b : b + 1, p : p + 1])
    assert torch.equal(te.attention(q[:, 33:], k, v, pos[:, 33:], 0.3, window), full[:, 33:])


@pytest.mark.parametrize(("window", "heads", "kv_heads"), [(None, 4, 2), (20, 6, 3)])
def test_interpreted_paged_attention_reads_the_cache_in_place_with_the_gathered_bits(
    te, window, heads, kv_heads
):
    """``paged_attention`` (keys read through the block table) == ``attention`` over the block table's
    gathered width, bit for bit: decode queries (one per row, a padding row at position 0) and prefill
    queries against cached keys, 3 key blocks deep; blocks in shuffled order, unreferenced and
    past-the-context slots hold junk."""
    g = torch.Generator().manual_seed(3)
    page, width, num_blocks, d = 16, 9, 30, 16
    cache = torch.randn(2, num_blocks, page, kv_heads, d, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: 3 * width].view(3, width).to(torch.int32)
    tables[1, 4:] = 0  # a short row: the table's tail is padding
    gathered = cache.flatten(2).index_select(1, tables.view(-1).long()).view(2, 3, width * page, kv_heads, d)
    decode_pos = torch.tensor([[140], [0], [63]])
    q = torch.randn(3, 1, heads, d, generator=g)
    paged = te.paged_attention(q, cache, tables, decode_pos, 0.3, window)
    assert torch.equal(paged, te.attention(q, gathered[0], gathered[1], decode_pos, 0.3, window))
    prefill_pos = torch.tensor([[120], [50], [64]]) + torch.arange(7)
    q = torch.randn(3, 7, heads, d, generator=g)
    paged = te.paged_attention(q, cache, tables, prefill_pos, 0.3, window)
    assert torch.equal(paged, te.attention(q, gathered[0], gathered[1], prefill_pos, 0.3, window))
    assert (
        paged.double() - ref_attention(q, gathered[0], gathered[1], prefill_pos, 0.3, window)
    ).abs().max() < 1e-5


def test_ops_on_the_kernels_have_the_reference_gradients(on_kernels, monkeypatch):
    """The kernels have no backward of their own: ``_invariant`` gives the torch formulation's."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7, 32, generator=g, requires_grad=True)
    w = torch.randn(48, 32, generator=g, requires_grad=True)
    out = bi.linear(x, w)
    assert torch.equal(out.detach(), on_kernels.matmul(x.detach().view(-1, 32), w.detach()).view(5, 7, 48))
    (out * torch.linspace(-1, 1, 48)).sum().backward()
    ref_x, ref_w = x.detach().requires_grad_(), w.detach().requires_grad_()
    (torch.nn.functional.linear(ref_x, ref_w) * torch.linspace(-1, 1, 48)).sum().backward()
    assert torch.allclose(x.grad, ref_x.grad) and torch.allclose(w.grad, ref_w.grad)

    q = torch.randn(2, 9, 4, 16, generator=g, requires_grad=True)
    kv = torch.randn(2, 9, 2, 16, generator=g, requires_grad=True)
    pos = torch.arange(9).expand(2, 9)
    bi.attention(q, kv, kv, pos, 0.25).square().sum().backward()
    ref_q, ref_kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    ref_attention(ref_q, ref_kv, ref_kv, pos, 0.25).float().square().sum().backward()
    assert torch.allclose(q.grad, ref_q.grad, atol=1e-5) and torch.allclose(kv.grad, ref_kv.grad, atol=1e-5)

    # the log-prob's gradient, computed in chunks of rows (2 here), per-row temperatures
    monkeypatch.setattr(bi.logprobs._TokenLogprobs, "CHUNK", 2)
    logits = torch.randn(3, 50, generator=g, requires_grad=True)
    tokens, temps, weights = (
        torch.tensor([1, 7, 49]),
        torch.tensor([0.7, 1.0, 1.3]),
        torch.tensor([1.0, -2.0, 0.5]),
    )
    (bi.token_logprobs(logits, tokens, temps) * weights).sum().backward()
    expected = torch.nn.functional.one_hot(tokens, 50) - torch.softmax(logits.detach() / temps[:, None], -1)
    assert torch.allclose(logits.grad, expected * (weights / temps)[:, None], atol=1e-6)


def test_interpreted_logprobs_over_vocabulary_slices(te, monkeypatch):
    """``token_logprobs`` with the vocabulary in several slices (small ones here, 8 and a partial ninth):
    float64's values, row-invariant, and a slice of only -inf logits (masked tokens) adds nothing."""
    rows_module = sys.modules[te.token_logprobs.__module__]  # triton_exact_rows, interpreted
    monkeypatch.setattr(rows_module, "VOCAB_BLOCK", 64)
    monkeypatch.setattr(rows_module, "VOCAB_CHUNK", 128)
    g = torch.Generator().manual_seed(3)
    logits, tokens = torch.randn(5, 1000, generator=g) * 4, torch.randint(0, 256, (5,), generator=g)
    logits[:, 256:384] = float("-inf")
    temps = torch.rand(5, generator=g) + 0.3
    lp = te.token_logprobs(logits, tokens, temps)
    assert (lp.double() - ref_token_logprobs(logits, tokens, temps)).abs().max().item() < 1e-5
    assert torch.equal(te.token_logprobs(logits[3:4], tokens[3:4], temps[3:4]), lp[3:4])


@pytest.fixture
def fused_kernels(monkeypatch):
    """The engine's exact decoder with the default path's fused RoPE + KV store kernel too
    (``triton_fused``), interpreted, as it runs on CUDA. Not its SiLU * up kernel: that one matches CUDA's
    ``expf`` (libdevice), which the interpreter's numpy exp and torch's CPU SiLU (SLEEF) each miss by an
    ulp at times; the gpu tests compare it with torch on CUDA."""
    from tidal.rollout.models import layers

    with interpreted({"tidal.rollout.models.triton_fused": "_rope_store_kv_kernel"}) as (fused,):
        monkeypatch.setattr(layers, "fused_kernels_usable", lambda x: True)
        calls = []
        kernel = fused.rope_store_kv
        monkeypatch.setattr(
            fused, "rope_store_kv", lambda *a, **kw: calls.append(a[0].shape) or kernel(*a, **kw)
        )
        yield calls


@pytest.mark.parametrize("fused", [False, True], ids=["exact-ops", "with-fused-kernels"])
def test_interpreted_engine_and_trainer_logprobs_are_bit_identical(tiny_model, on_kernels, request, fused):
    """The CUDA dispatch end to end on CPU: the engine (prefill and decode) and the trainer's exact forward,
    both on the kernels, give the same log-probs (float32); also with the fused RoPE + KV store and SiLU * up
    kernels the engine takes on CUDA."""
    from transformers import AutoModelForCausalLM

    from tidal.rollout import EngineConfig, LLMEngine
    from tidal.rollout.sampling_params import SamplingParams

    path = tiny_model(
        "qwen2",
        logit_scale=4.0,
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
    )
    prompts = [list(range(5, 17)), list(range(40, 43)), list(range(7, 30))]
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=m, seed=i, ignore_eos=True)
        for i, m in enumerate((4, 2, 3))
    ]
    calls = request.getfixturevalue("fused_kernels") if fused else None
    config = EngineConfig(device="cpu", max_model_len=64, num_kv_blocks=16, exact_logprobs=True)
    outputs = LLMEngine(path, config).generate(prompts, params)
    hf = bi.make_exact(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval())
    assert _trainer_gaps(hf, prompts, outputs, torch.device("cpu")) == 0.0
    if fused:  # prefill and decode steps (one token a row) took it
        assert {c[0] for c in calls} >= {3, 38}
