"""PPO and GSPO clipped surrogate losses."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.masked import aggregate_loss
from tidal.algorithms.policy_loss import POLICY_LOSSES, gspo_policy_loss, ppo_policy_loss

RATIOS = [1.5, 0.5, 1.0]
ADV = torch.tensor([[1.0, -1.0, 2.0]])
MASK = torch.ones(1, 3)


def logp_for(ratios):
    return torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)


def test_registry_keys():
    assert set(POLICY_LOSSES) == {"ppo", "gspo"}


def test_ppo_by_hand_with_clip_stats_and_gradient():
    logp = logp_for(RATIOS)
    loss, stats = ppo_policy_loss(logp, torch.zeros(1, 3), ADV, MASK, clip_eps_low=0.2)
    # 1.5*1 clipped to 1.2; 0.5*(-1) vs 0.8*(-1): min is -0.8; 1.0*2 unclipped
    assert_close(loss, torch.tensor([[-1.2, 0.8, -2.0]]))
    assert_close(stats["clip_ratio"], torch.tensor(2 / 3))
    kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5)) + 0.0) / 3
    assert_close(stats["approx_kl"], torch.tensor(kl))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # d(-rho*A)/dlogp = -rho*A where unclipped, 0 where the clipped branch is taken
    assert_close(grad, torch.tensor([[0.0, 0.0, -2.0]]))


def test_ppo_clip_higher():
    loss, _ = ppo_policy_loss(
        logp_for(RATIOS), torch.zeros(1, 3), ADV, MASK, clip_eps_low=0.2, clip_eps_high=0.28
    )
    assert_close(loss, torch.tensor([[-1.28, 0.8, -2.0]]))


def test_dual_clip_by_hand():
    logp = logp_for([10.0, 2.0, 10.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    plain, _ = ppo_policy_loss(logp, torch.zeros(1, 3), adv, MASK)
    assert_close(plain, torch.tensor([[10.0, 2.0, -1.2]]))
    dual, stats = ppo_policy_loss(logp, torch.zeros(1, 3), adv, MASK, dual_clip=3.0)
    assert_close(dual, torch.tensor([[3.0, 2.0, -1.2]]))  # min(10, 3*|A|) for A < 0 only
    assert_close(stats["dual_clip_ratio"], torch.tensor(1 / 3))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(logp, torch.zeros(1, 3), adv, MASK, dual_clip=1.0)


def test_dual_clip_bounds_negative_advantages_only():
    gen = torch.Generator().manual_seed(4)
    logp = torch.randn(8, 16, generator=gen) * 3
    adv = torch.randn(8, 16, generator=gen)
    mask = torch.ones(8, 16)
    plain, _ = ppo_policy_loss(logp, torch.zeros_like(logp), adv, mask)
    dual, _ = ppo_policy_loss(logp, torch.zeros_like(logp), adv, mask, dual_clip=3.0)
    negative = adv < 0
    assert (dual[negative] <= 3.0 * adv.abs()[negative] + 1e-6).all()
    assert_close(dual[~negative], plain[~negative])
    assert (plain[negative] > 3.0 * adv.abs()[negative]).any()  # the bound did bite somewhere


def test_masked_garbage_gives_zero_loss_and_finite_gradient():
    logp = torch.tensor([[-0.1, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-0.2, 0.0]])
    mask = torch.tensor([[1, 0]])
    for loss_fn in POLICY_LOSSES.values():
        loss, _ = loss_fn(logp, old, torch.tensor([[1.0, 1.0]]), mask, clip_eps_low=0.2, clip_eps_high=0.2)
        assert loss[0, 1].item() == 0.0
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(grad).all() and grad[0, 1].item() == 0.0


def test_gspo_sequence_ratio_by_hand():
    logp = torch.tensor([[0.2, -0.1], [0.3, 7.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = gspo_policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    s0, s1 = math.exp(0.05), math.exp(0.3)  # exp of the mean log-ratio of each sequence
    assert_close(loss, torch.tensor([[-s0, -s0], [s1, 0.0]]))
    tight, stats = gspo_policy_loss(logp, old, adv, mask)  # paper eps 3e-4 / 4e-4
    # seq 0 (A>0) clipped at 1 + 4e-4; seq 1 (A<0, s>1): the unclipped branch is the min
    assert_close(tight, torch.tensor([[-1.0004, -1.0004], [s1, 0.0]]))
    assert_close(stats["clip_ratio"], torch.tensor(2 / 3))


def test_gspo_token_gradient_equals_sequence_level_gspo():
    gen = torch.Generator().manual_seed(5)
    logp = (torch.randn(3, 5, generator=gen) * 0.1).requires_grad_()
    old = torch.randn(3, 5, generator=gen) * 0.1
    adv = torch.tensor([1.0, -0.5, 2.0]).unsqueeze(1).expand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]).bool()
    eps = 0.05

    loss, _ = gspo_policy_loss(logp, old, adv, mask, clip_eps_low=eps, clip_eps_high=eps)
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "sequence"), logp)

    # reference: the paper's sequence objective written out directly
    lengths = mask.sum(-1)
    s = torch.exp(((logp - old) * mask).sum(-1) / lengths)
    a = adv[:, 0]
    reference = -torch.min(s * a, s.clamp(1 - eps, 1 + eps) * a).mean()
    (ref_grad,) = torch.autograd.grad(reference, logp)
    assert_close(grad, ref_grad)
