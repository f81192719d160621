"""KL penalty between the policy and the reference model, and KL-coefficient controllers.

Per-token estimators of KL(π || π_ref) from samples of π, with r = log π − log π_ref
(J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):

- ``k1 = r``                      unbiased, high variance, can be negative;
- ``k2 = r² / 2``                 biased, low variance, ≥ 0;
- ``k3 = exp(−r) − 1 + r``        unbiased, low variance, ≥ 0 (the GRPO paper's KL, arXiv 2402.03300).

``compute_kl`` clamps the *estimate* to ``[−kl_clip, kl_clip]`` (default 10), as OpenRLHF's
``compute_approx_kl`` does for all three estimators, so no token's KL term exceeds 10 (clamping r
instead would let k3 reach e^10 − 11 ≈ 2.2e4). The clamp also stops the gradient of clamped tokens,
which is intended (they are outliers, not signal). Before the estimator r is clamped to
``±(kl_clip + 1)``: every estimator is already beyond ±kl_clip there (k1: |r|; k2: r²/2 ≥ kl_clip;
k3: ≥ r − 1 for r > 0 and e^|r| − 1 − |r| for r < 0), so no value changes, but ``exp(−r)`` stays
finite and a clamped token's gradient is 0 instead of 0·inf = nan. Pass ``None`` to disable both.

The controllers hold β (``init_kl_coef``): fixed, or adaptive as in Ziegler et al. 2019
(arXiv 1909.08593): β ← β·(1 + clip(KL/target − 1, −0.2, 0.2)·n_steps/horizon).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tidal.algorithms.registry import register

KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {}


@register(KL_ESTIMATORS, "k1")
def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = r."""
    return log_ratio


@register(KL_ESTIMATORS, "k2")
def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = r² / 2."""
    return 0.5 * log_ratio.pow(2)


@register(KL_ESTIMATORS, "k3")
def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(−r) − 1 + r (``expm1`` keeps it accurate for small r)."""
    return torch.expm1(-log_ratio) + log_ratio


KL_CLIP = 10.0  # OpenRLHF's clamp of the per-token estimate


def compute_kl(
    logp: Tensor,
    ref_logp: Tensor,
    action_mask: Tensor | None = None,
    estimator: str = "k1",
    kl_clip: float | None = KL_CLIP,
) -> Tensor:
    """Per-token KL estimate ``[B, T]`` from log-probs of the sampled tokens, clamped to ``±kl_clip``;
    0 where masked."""
    log_ratio = logp.float() - ref_logp.float()
    if kl_clip is None:
        kl = KL_ESTIMATORS[estimator](log_ratio)
    else:
        bound = kl_clip + 1.0  # beyond it every estimate is clamped anyway (module docstring)
        kl = KL_ESTIMATORS[estimator](log_ratio.clamp(-bound, bound)).clamp(-kl_clip, kl_clip)
    if action_mask is not None:
        kl = torch.where(action_mask.bool(), kl, torch.zeros_like(kl))
    return kl


@dataclass
class FixedKLController:
    """Constant β."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


@dataclass
class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, arXiv 1909.08593): steer the measured KL towards ``target``.

    ``update(current_kl, n_steps)`` moves β by at most ±20% per ``horizon`` samples seen.
    """

    value: float
    target: float
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> float:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value


def make_kl_controller(
    init_kl_coef: float, kl_target: float | None = None, kl_horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Fixed controller unless a KL target is set (the seed's ``--kl_target``/``--kl_horizon``)."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
