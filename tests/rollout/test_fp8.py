"""FP8 quantization's pure functions (``tidal/rollout/quant/fp8.py``): hand-derived rounding and error bounds
per scale granularity, and the edge rows (zeros, outliers, all-equal values).

The bound: e4m3 has 3 mantissa bits, so a scaled value ``w / s`` of the normal range (``>= 2**-6``)
rounds to nearest with a relative error of at most ``2**-4``; below it (subnormals, spacing ``2**-9``)
the absolute error is at most ``2**-10 * s``. The extra ``2**-20`` covers the float32 product ``q * s``.
"""

from __future__ import annotations

import pytest
import torch

from tidal.rollout.quant.fp8 import (
    E4M3_MAX,
    QUANTIZATIONS,
    block_scales,
    dequantize,
    expand_block_scales,
    quantization_problem,
    quantize,
    quantize_dequantize,
    quantize_rows,
)


def _element_scales(w: torch.Tensor, granularity: str) -> torch.Tensor:
    _, scales = quantize(w, granularity)
    return scales if granularity == "channel" else expand_block_scales(scales, tuple(w.shape[-2:]))


def _assert_within_bound(w: torch.Tensor, granularity: str) -> None:
    s = _element_scales(w, granularity).double()
    err = (quantize_dequantize(w, granularity).double() - w.double()).abs()
    normal = w.double().abs() / s >= 2**-6
    rel_bound = (2**-4 + 2**-20) * w.double().abs()
    assert (err[normal] <= rel_bound[normal]).all()
    assert (err[~normal] <= (2**-10 * s + 2**-20 * w.double().abs())[~normal]).all()


def test_e4m3_rounding_by_hand():
    """With a row maximum of 448 the scale is 1 and the values are e4m3's own: 1 + 1/16 lies halfway
    between 1 and 1.125 and rounds to the even mantissa (1); 1 + 3/16 halfway between 1.125 and 1.25
    rounds to 1.25; 300 lies between 288 and 320 (spacing 32 above 256) and rounds to 288."""
    w = torch.tensor([[448.0, 1.0625, 1.1875, 300.0, -0.5, 2.0**-9]])
    q, scales = quantize(w, "channel")
    assert scales.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 288.0, -0.5, 2.0**-9]]


@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_the_e4m3_bound(granularity, dtype):
    torch.manual_seed(0)
    w = (torch.randn(200, 300) * torch.logspace(-3, 2, 300)).to(dtype)  # columns of very different sizes
    if dtype == torch.float32:
        _assert_within_bound(w, granularity)
    else:  # the result is rounded once more, to bf16's 8 bits: half an ulp, 2**-9 relative
        s = _element_scales(w, granularity).double()
        err = (quantize_dequantize(w, granularity).double() - w.double()).abs()
        assert (err <= (2**-4 + 2**-8) * w.double().abs() + 2**-10 * s).all()
    assert quantize_dequantize(w, granularity).dtype == dtype


def test_block_scales_are_per_128_tile_and_the_tile_maximum_is_kept():
    torch.manual_seed(1)
    w = torch.randn(200, 300)
    w[150, 270] = 50.0  # the maximum of tile (1, 2), a partial tile
    scales = block_scales(w)
    assert scales.shape == (2, 3)
    assert scales[1, 2].item() == pytest.approx(50.0 / E4M3_MAX)
    assert scales[0, 0].item() == pytest.approx(w[:128, :128].abs().max().item() / E4M3_MAX)
    dq = quantize_dequantize(w, "block")
    assert dq[150, 270].item() == pytest.approx(50.0, rel=2**-22)


def test_channel_scales_per_row_of_stacked_experts():
    torch.manual_seed(2)
    w = torch.randn(3, 8, 16)  # [experts, out, in]
    q, scales = quantize(w, "channel")
    assert scales.shape == (3, 8, 1)
    torch.testing.assert_close(scales[:, :, 0], w.abs().amax(-1) / E4M3_MAX)
    assert (q.float().abs().amax(-1) == E4M3_MAX).all()  # each row's maximum maps to 448
    _assert_within_bound(w, "channel")
    _assert_within_bound(w, "block")


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_zero_rows_stay_zero_with_scale_one(granularity):
    w = torch.zeros(4, 130)
    w[1] = torch.linspace(-1, 1, 130)
    q, scales = quantize(w, granularity)
    dq = dequantize(q, scales, granularity, torch.float32)
    assert torch.equal(dq[0], torch.zeros(130)) and torch.equal(dq[2:], torch.zeros(2, 130))
    assert not dq.isnan().any()
    if granularity == "channel":
        assert scales[0].item() == 1.0 and scales[1].item() == pytest.approx(1 / E4M3_MAX)
    else:
        zero_tile = torch.zeros(128, 128)
        assert quantize(zero_tile, "block")[1].item() == 1.0


def test_an_outlier_sets_the_row_scale_and_small_values_keep_the_absolute_bound():
    """One 1e4 in a row of values near 1e-3: the scale is 1e4/448, the small values fall below e4m3's
    smallest subnormal (2**-9 of the scale: ~0.05) and round to zero, within the absolute bound."""
    w = torch.full((1, 64), 1e-3)
    w[0, 7] = 1e4
    dq = quantize_dequantize(w, "channel")
    assert dq[0, 7].item() == pytest.approx(1e4, rel=2**-22)
    assert (dq[0, torch.arange(64) != 7] == 0).all()
    _assert_within_bound(w, "channel")


@pytest.mark.parametrize("value", [3.0, -0.0123, 7e5])
def test_all_equal_rows_come_back_exactly(value):
    """Every element is the row maximum: it maps to 448 and back to itself (up to the float32 product)."""
    w = torch.full((2, 32), value)
    dq = quantize_dequantize(w, "channel")
    torch.testing.assert_close(dq, w, rtol=2**-22, atol=0)
    torch.testing.assert_close(quantize_dequantize(w, "block"), w, rtol=2**-22, atol=0)


def test_activation_rows_are_quantized_per_token_and_group():
    torch.manual_seed(3)
    x = torch.randn(5, 256) * torch.arange(1, 6)[:, None]
    q, scales = quantize_rows(x)
    assert scales.shape == (5, 1) and q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scales[:, 0], x.abs().amax(-1) / E4M3_MAX)
    q, scales = quantize_rows(x, 128)
    assert scales.shape == (5, 2)
    torch.testing.assert_close(scales[:, 1], x[:, 128:].abs().amax(-1) / E4M3_MAX)
    back = (q.float().view(5, 2, 128) * scales[..., None]).view(5, 256)
    assert ((back - x).abs() <= 2**-4 * x.abs() + 2**-10 * scales.repeat_interleave(128, 1)).all()


def test_scales_are_amax_times_the_float32_reciprocal_of_448_bit_for_bit():
    """What torch computes for ``amax / 448`` on CUDA (a product with the rounded reciprocal), written so on
    every device: with a division instead, 3 of these 5 scales would be an ulp away."""
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(0)) * 3
    _, scales = quantize_rows(x)
    inverse = torch.tensor(1.0) / torch.tensor(448.0)  # float32 IEEE division
    assert torch.equal(scales[:, 0], x.abs().amax(-1) * inverse)
    assert not torch.equal(scales[:, 0], x.abs().amax(-1) / torch.tensor(448.0))


def test_rows_too_small_for_their_scale_quantize_to_zero_not_nan():
    """A row whose largest value is far in float32's subnormals has a scale that underflows (to 0 below
    ~4.5e-43, else a subnormal) and a reciprocal that overflows; ``0 * inf`` would make the row's zeros
    NaN. The reciprocal is capped at float32's largest value, so the row comes back as (about) itself."""
    x = torch.zeros(3, 8)
    x[0, 0] = 1e-44
    x[1, :2] = torch.tensor([1e-40, -3e-41])
    x[2, 0] = 1.0
    q, scales = quantize_rows(x)
    assert scales[0, 0].item() == 0.0 and torch.isinf(scales[:2].reciprocal()).all()
    assert torch.isnan(x[0] * scales[0].reciprocal()).any()  # what an uncapped reciprocal would give
    assert not q.float().isnan().any()
    assert (q.float() * scales - x).abs().max().item() < 1e-38
    assert q[2, 0].float().item() == E4M3_MAX and (q[:, 1:].float()[2:] == 0).all()


def test_quantization_values_are_checked():
    assert QUANTIZATIONS == ("none", "fp8", "fp8_block")
    assert all(quantization_problem(v) is None for v in QUANTIZATIONS)
    assert quantization_problem("int8") == (
        "--rollout_quantization must be one of none, fp8, fp8_block, not 'int8'"
    )
    from tidal.config.rl import ROLLOUT_QUANTIZATIONS

    assert ROLLOUT_QUANTIZATIONS == QUANTIZATIONS  # the flag's choices (written out: --help imports no torch)
