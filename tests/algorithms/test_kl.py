"""KL estimators and KL-coefficient controllers."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_kl,
    make_kl_controller,
)

LOGP = torch.tensor([[0.0, -1.0, -3.0]])
REF = torch.tensor([[-0.5, -0.5, -1.0]])  # r = [0.5, -0.5, -2.0]
MASK = torch.tensor([[1, 1, 0]])


def test_registry_keys():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_estimators_by_hand_and_masking():
    assert_close(compute_kl(LOGP, REF, MASK, "k1"), torch.tensor([[0.5, -0.5, 0.0]]))
    assert_close(compute_kl(LOGP, REF, MASK, "k2"), torch.tensor([[0.125, 0.125, 0.0]]))
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5, 0.0]
    assert_close(compute_kl(LOGP, REF, MASK, "k3"), torch.tensor([k3]))
    # unmasked third token: r = -2 -> k3 = e^2 - 3
    assert_close(compute_kl(LOGP, REF, None, "k3")[0, 2], torch.tensor(math.exp(2) - 3))


def test_k2_k3_nonnegative_and_k3_zero_at_equal_policies():
    r = torch.linspace(-5, 5, 101).unsqueeze(0)
    assert (compute_kl(r, torch.zeros_like(r), estimator="k2") >= 0).all()
    assert (compute_kl(r, torch.zeros_like(r), estimator="k3") >= 0).all()
    assert compute_kl(LOGP, LOGP, estimator="k3").abs().max() == 0


def openrlhf_compute_approx_kl(log_probs, log_probs_base, kl_estimator):
    """OpenRLHF v0.9.2 ``openrlhf/models/utils.py::compute_approx_kl``, verbatim in substance."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k2":
        log_ratio = log_ratio**2 / 2.0
    if kl_estimator == "k3":
        log_ratio = -log_ratio
        log_ratio = log_ratio.exp() - 1 - log_ratio
    return log_ratio.clamp(min=-10, max=10)


def test_large_log_ratio_clamps_the_estimate_to_10():
    """The estimate, not r, is clamped: k3 at r = −10 was e^10 − 11 ≈ 2.2e4 per token."""
    logp = torch.tensor([[50.0, -100.0, -10.0, -2.5, 3.0, 12.0]])
    ref = torch.zeros_like(logp)
    assert_close(compute_kl(logp, ref, estimator="k3"), torch.tensor([[10.0, 10.0, 10.0, math.exp(2.5) - 3.5,
                                                                       math.exp(-3) + 2, 10.0]]))  # fmt: skip
    assert_close(compute_kl(logp, ref, estimator="k1"), torch.tensor([[10.0, -10.0, -10.0, -2.5, 3.0, 10.0]]))
    assert_close(compute_kl(logp, ref, estimator="k2"), torch.tensor([[10.0, 10.0, 10.0, 3.125, 4.5, 10.0]]))
    assert torch.isinf(compute_kl(logp, ref, estimator="k3", kl_clip=None)[0, 1])


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_matches_openrlhf_on_random_and_extreme_log_ratios(name):
    g = torch.Generator().manual_seed(0)
    logp = torch.cat([torch.randn(4, 64, generator=g) * 4, torch.linspace(-60, 60, 64).unsqueeze(0)])
    ref = torch.randn(5, 64, generator=g)
    assert_close(compute_kl(logp, ref, estimator=name), openrlhf_compute_approx_kl(logp, ref, name))


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_clamped_tokens_get_a_zero_not_a_nan_gradient(name):
    logp = torch.tensor([[-200.0, 200.0, 0.3]], requires_grad=True)
    (grad,) = torch.autograd.grad(compute_kl(logp, torch.zeros_like(logp), estimator=name).sum(), logp)
    assert torch.isfinite(grad).all() and grad[0, :2].abs().max() == 0


def test_adaptive_controller_by_hand():
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    assert ctl.update(current_kl=9.0, n_steps=1000) == pytest.approx(0.1 * 1.02)  # error 0.5 clipped to 0.2
    assert ctl.update(current_kl=5.4, n_steps=1000) == pytest.approx(0.1 * 1.02 * 0.99)  # error -0.1
    assert ctl.update(current_kl=0.0, n_steps=1000) == pytest.approx(0.1 * 1.02 * 0.99 * 0.98)  # -1 -> -0.2


def test_fixed_controller_and_factory():
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 1000) == 0.05
    assert isinstance(make_kl_controller(0.05), FixedKLController)
    adaptive = make_kl_controller(0.05, kl_target=1.0, kl_horizon=500)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.horizon == 500


def test_kl_loss_gradients_by_hand():
    # d k1/dlogp = 1, d k2/dlogp = r, d k3/dlogp = 1 - exp(-r); r = [0.5, -0.5], third token masked
    for name, expected in {
        "k1": [1.0, 1.0, 0.0],
        "k2": [0.5, -0.5, 0.0],
        "k3": [1 - math.exp(-0.5), 1 - math.exp(0.5), 0.0],
    }.items():
        logp = LOGP.clone().requires_grad_()
        (grad,) = torch.autograd.grad(compute_kl(logp, REF, MASK, name).sum(), logp)
        assert_close(grad, torch.tensor([expected]))
