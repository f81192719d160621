"""The FP8 linear layers' Triton GEMM (``quant/triton_fp8_gemm.py``) run by Triton's interpreter on the CPU
(skipped without triton, and where CUDA runs the compiled kernel: tests/rollout/test_fp8_gpu.py covers it
there), and its launch rules.

Each launch against the float32 product of the very e4m3 operands and scales it was given (the
interpreter widens fp8 tiles to float16 for ``tl.dot``, exactly), per channel and per 128 x 128 block,
with and without a bias, in one K range and cut into several (the split-K workspace and its reduction),
at row and column counts that are not multiples of the tile; far from it with another row's scales.
"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.triton_interpreter import interpreted
from tidal.rollout.quant import fp8_gemm_config
from tidal.rollout.quant.fp8 import dequantize, quantize, quantize_rows
from tidal.rollout.quant.gemm import padded_block_scales


@pytest.fixture(scope="module")
def gemm():
    with interpreted({"tidal.rollout.quant.triton_fp8_gemm": "_fp8_gemm_kernel"}) as (module,):
        yield module


Fp8GemmConfig = fp8_gemm_config.Fp8GemmConfig


def operands(m: int, n: int, k: int, granularity: str, seed: int):
    """(e4m3 activations, their scales, e4m3 weight, its scales, bias, the float32 product + bias)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 4 ** (2 * torch.rand(m, 1, generator=gen) - 1)  # rows of any size
    w = torch.randn(n, k, generator=gen) * 4 ** (2 * torch.rand(n, 1, generator=gen) - 1) / k**0.5
    bias = torch.randn(n, generator=gen)
    wq, ws = quantize(w, granularity)
    xq, xs = quantize_rows(x, 128 if granularity == "block" else None)
    x_deq = xq.float() * (xs.repeat_interleave(128, dim=1) if granularity == "block" else xs)
    want = x_deq @ dequantize(wq, ws, granularity, torch.float32).t()
    return xq, xs, wq, ws, bias, want


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 37])
def test_per_channel_launch_is_the_product_of_its_e4m3_operands(gemm, m, bias, split_k):
    xq, xs, wq, ws, b, want = operands(m, 200, 640, "channel", seed=m + split_k)
    config = Fp8GemmConfig(block_m=16, block_n=64, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    got = gemm.fp8_gemm(xq, xs, wq, ws, config, b if bias else None, torch.float32)
    assert got.shape == (m, 200) and got.dtype == torch.float32
    assert rel(got, want + b if bias else want) < 1e-6
    wrong = xs.roll(1, 0) if m > 1 else xs * 2  # another row's scale
    assert rel(gemm.fp8_gemm(xq, wrong, wq, ws, config, None, torch.float32), want) > 0.05


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("split_k", [1, 2])
def test_block_scaled_launch_scales_each_k_block(gemm, split_k, padded):
    """``fp8_block``: [M, K/128] activation scales (outer-dimension-major, as the quantization launch writes
    them) and the weight's [N/128, K/128], as ``quantize`` returns them or padded to the engine buffers'
    column count (read through their strides, no copy); N not a multiple of 128."""
    xq, xs, wq, ws, b, want = operands(9, 200, 384, "block", seed=split_k)
    xs_outer = xs.t().contiguous().t()
    weight_scales = padded_block_scales(ws) if padded else ws
    assert weight_scales.shape[1] == (4 if padded else 3)
    config = Fp8GemmConfig(block_m=16, block_n=64, block_k=128, split_k=split_k, num_warps=4, num_stages=2)
    got = gemm.fp8_gemm(xq, xs_outer, wq, weight_scales, config, b, torch.float32, block_scaled=True)
    assert rel(got, want + b) < 1e-6
    # one K block's scales swapped with another's: that block's products are scaled wrongly
    swapped = xs_outer.clone()
    swapped[:, [0, 1]] = xs_outer[:, [1, 0]]
    assert (
        rel(gemm.fp8_gemm(xq, swapped, wq, ws, config, None, torch.float32, block_scaled=True), want) > 0.05
    )
    with pytest.raises(ValueError, match="block_k 128"):
        gemm.fp8_gemm(xq, xs_outer, wq, ws, Fp8GemmConfig(16, 64, 64), None, torch.float32, block_scaled=True)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_a_tma_launch_loads_its_tiles_through_descriptors_and_gives_the_product(
    gemm, monkeypatch, granularity, split_k
):
    """``tma=1``: tiles loaded through tensor descriptors, whose rows past M, columns past N and K tail
    must read as zeros (37 rows, 200 columns, K = 640 = 5 K steps cut into 3 ranges: partial tiles on all
    three); an operand the copy engine cannot describe (here: a weight whose rows are not 16-byte aligned)
    takes the pointer loads."""
    monkeypatch.setattr(gemm, "tma_loadable", lambda t: t.stride(1) == 1 and t.stride(0) % 16 == 0)
    described = []
    real = gemm.tma_descriptor
    monkeypatch.setattr(gemm, "tma_descriptor", lambda t, r, c: described.append((r, c)) or real(t, r, c))
    block = granularity == "block"
    xq, xs, wq, ws, b, want = operands(37, 200, 640, granularity, seed=split_k)
    xs = xs.t().contiguous().t() if block else xs
    config = Fp8GemmConfig(16, 64, 128, split_k, num_warps=4, num_stages=2, tma=1)
    bias = None if block else b
    got = gemm.fp8_gemm(xq, xs, wq, ws, config, bias, torch.float32, block_scaled=block)
    assert described == [(16, 128), (64, 128)]
    assert rel(got, want if block else want + b) < 1e-6
    odd = torch.empty(200, 648, dtype=wq.dtype)[:, :640]  # rows 648 bytes apart: not a multiple of 16
    odd.copy_(wq)
    described.clear()
    pointers = gemm.fp8_gemm(xq, xs, odd, ws, config, bias, torch.float32, block_scaled=block)
    assert described == [] and rel(pointers, want if block else want + b) < 1e-6


def test_no_rows(gemm):
    xq, xs, wq, ws, _, _ = operands(1, 64, 128, "channel", seed=0)
    out = gemm.fp8_gemm(xq[:0], xs[:0], wq, ws, Fp8GemmConfig(16, 64), None, torch.bfloat16)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_default_tiles_fill_the_gpu_with_k_ranges_where_tiles_are_few():
    """No GPU needed: ``default_config`` is a rule on shapes. A 7B ``down_proj`` at 256 tokens has 56
    output tiles of 128 x 128 on 132 SMs: K is cut; the wide gate/up has tiles enough: it is not. Every
    range is at least four K steps long, and one token takes the smallest row tile."""
    from tidal.rollout.quant.fp8_gemm_config import default_config

    down = default_config(256, 3584, 18944, sms=132)
    assert (down.block_m, down.block_n, down.split_k) == (128, 128, 2)
    assert default_config(256, 37888, 3584, sms=132).split_k == 1
    one = default_config(1, 3584, 18944, sms=132)
    assert (one.block_m, one.block_n, one.split_k) == (16, 64, 2)  # 56 narrower tiles: two K ranges
    short = default_config(1, 896, 896, sms=132)
    assert short.split_k == 1  # 7 K steps: no range of four or more to cut off
    for m, n, k in [(1, 896, 4864), (64, 4608, 3584), (256, 896, 896), (512, 18944, 3584)]:
        c = default_config(m, n, k, sms=132)
        tiles = -(-m // c.block_m) * -(-n // c.block_n)
        assert tiles * c.split_k <= max(132, tiles) and -(-k // 128) >= 4 * c.split_k or c.split_k == 1


def test_gemm_config_takes_the_measured_tile_and_leaves_large_token_counts_to_torch(monkeypatch):
    from tidal.rollout.quant import fp8_gemm_tuned
    from tidal.rollout.quant.fp8_gemm_config import Fp8GemmConfig, default_config, gemm_config

    tile = dict(block_m=64, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3)
    monkeypatch.setattr(fp8_gemm_tuned, "TUNED", {(3584, 18944): {64: tile, 256: None}})
    assert gemm_config(40, 3584, 18944, 132, False) == Fp8GemmConfig(**tile)
    assert gemm_config(256, 3584, 18944, 132, False) is None  # torch._scaled_mm measured faster
    assert gemm_config(8, 3584, 18944, 132, False) == default_config(8, 3584, 18944, 132)
    assert gemm_config(4096, 3584, 3584, 132, False) is None  # prefill: torch._scaled_mm
    # block scales: cuBLAS's block-wise GEMM refused token counts on the H200, so always the Triton kernel
    assert gemm_config(256, 3584, 18944, 132, True).block_k == 128
    assert gemm_config(4096, 3584, 3584, 132, True) is not None
