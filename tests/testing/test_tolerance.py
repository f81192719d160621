"""The reorder tolerance of 1-vs-N tests: wide enough for real reorderings, too tight for real bugs."""

from __future__ import annotations

import pytest
import torch

from tidal.testing.tolerance import (
    assert_same_steps,
    reorder_rtol,
    same_up_to_reordering,
    tiny_parameter_count,
)


def test_reordered_sums_of_a_tiny_models_size_stay_within_it():
    n = tiny_parameter_count("qwen2")
    assert 1_000_000 < n < 3_000_000
    rtol = reorder_rtol(n)
    g = torch.Generator().manual_seed(0)
    squares = torch.randn(n, generator=g).square()  # a gradient norm's terms, float32
    whole = squares.sum().sqrt().item()
    for seed in range(3):  # other orders and other splits over "ranks"
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        halves = [part.sum() for part in squares[order].chunk(2 + seed)]
        assert same_up_to_reordering(whole, torch.stack(halves).sum().sqrt().item(), rtol)
    # A doubled gradient or one rank's share missing is far outside it.
    assert not same_up_to_reordering(whole, 2 * whole, rtol)
    assert not same_up_to_reordering(whole, squares[: n // 2].sum().sqrt().item(), rtol)
    assert not same_up_to_reordering(whole, whole * (1 + 10 * rtol), rtol)


def test_it_scales_with_the_terms_and_the_dtype_and_refuses_to_hide_bugs():
    assert reorder_rtol(4) == pytest.approx(4 * torch.finfo(torch.float32).eps * 2)
    assert reorder_rtol(4, torch.float16) > 1000 * reorder_rtol(4)
    with pytest.raises(ValueError, match="would hide a doubled or missing gradient"):
        reorder_rtol(10**6, torch.bfloat16)


def test_assert_same_steps_names_the_step_and_key():
    one = [{"step": 1, "loss": 1.0, "tokens": 12}]
    assert_same_steps(one, [{"step": 1, "loss": 1.0 + 1e-6, "tokens": 12}], ("loss", "tokens"), 10**6)
    with pytest.raises(AssertionError, match="'tokens'"):
        assert_same_steps(one, [{"step": 1, "loss": 1.0, "tokens": 13}], ("loss", "tokens"), 10**6)
