"""How far apart two runs of one float computation may be when only the order of their sums differs.

A 1-vs-N-process comparison (or a resume onto another number of processes) computes the same losses and
gradients, but each process reduces its own share and the shares are then added: the same terms summed
in another order. A fixed absolute tolerance encodes one machine's rounding (a new torch or BLAS release
moves the last digits: issue #40, a 1.1e-5 gap failed a 1e-5 bound). The tolerance here is derived
from the computation instead:

- Summing ``n`` terms in a different order changes the result by about ``eps * sqrt(n)`` relative to the
  terms' magnitude (the probabilistic rounding-error bound of floating-point summation; the worst case
  ``eps * n`` is far from what random orders give). ``SAFETY`` covers correlated rounding and the error
  carried through an optimizer step into the next step's metrics.
- The metrics compared (losses, gradient norms) are means or norms of terms of order 1, so the error is
  scaled by ``max(|a|, |b|, 1)``: near zero, the terms that were summed still had magnitude ~1.
- ``n`` is the largest reduction that feeds the metrics: the model's parameter count (the gradient norm
  sums one square per parameter), which also bounds the per-token sums of a tiny batch.

For the tiny test models (~1.7M parameters, float32) this gives a relative tolerance of ~6e-4: two
orders of magnitude above what reordering produces, and far below what a real bug produces (a doubled,
missing or one-rank-only gradient moves the gradient norm by tens of percent). ``reorder_rtol`` refuses a
tolerance loose enough (>= 1e-2) to hide such a bug.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

import torch

SAFETY = 4.0
# A tolerance at or above this could not tell a doubled or missing gradient from rounding.
LOOSEST = 1e-2


def reorder_rtol(n_terms: int, dtype: torch.dtype = torch.float32, safety: float = SAFETY) -> float:
    """Relative tolerance between two sums of ``n_terms`` terms of ``dtype`` added in different orders."""
    if n_terms < 1:
        raise ValueError(f"n_terms must be >= 1, got {n_terms}")
    rtol = safety * torch.finfo(dtype).eps * math.sqrt(n_terms)
    if rtol >= LOOSEST:
        raise ValueError(
            f"a reorder tolerance of {rtol:.2g} ({n_terms} terms of {dtype}) would hide a doubled or missing "
            "gradient; compare fewer terms or in a wider dtype"
        )
    return rtol


def same_up_to_reordering(a: float, b: float, rtol: float) -> bool:
    """Whether two metric values differ by no more than reordering their sums explains."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1.0)


def assert_same_steps(
    one: Sequence[dict],
    two: Sequence[dict],
    keys: Sequence[str],
    n_terms: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Per-step metrics of two runs (1 vs N processes, resumed vs not) agree up to reordering."""
    rtol = reorder_rtol(n_terms, dtype)
    assert len(one) == len(two) and len(one) > 0, (len(one), len(two))
    for a, b in zip(one, two, strict=True):
        for key in keys:
            assert same_up_to_reordering(a[key], b[key], rtol), (a.get("step"), key, a[key], b[key], rtol)


@cache
def tiny_parameter_count(family: str = "qwen2", **overrides) -> int:
    """Parameters of ``tidal.testing``'s tiny model of ``family`` (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    from tidal.testing.tiny import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return sum(p.numel() for p in model.parameters())
