"""Reward-model pairwise losses, DPO/cDPO/IPO and KTO."""

import math

import torch
from torch.testing import assert_close

from tidal.algorithms.preference import DPO_LOSSES, RM_LOSSES, kto_kl_estimate, kto_loss


def softplus(x):
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


def test_registry_keys():
    assert set(RM_LOSSES) == {"sigmoid", "logexp"}
    assert set(DPO_LOSSES) == {"sigmoid", "ipo"}


def test_rm_losses_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    expected = torch.tensor([softplus(-1.0), softplus(1.0)])
    assert_close(RM_LOSSES["sigmoid"](chosen, rejected), expected)
    assert_close(RM_LOSSES["logexp"](chosen, rejected), expected)
    margin = torch.tensor([0.5, 0.0])
    assert_close(
        RM_LOSSES["sigmoid"](chosen, rejected, margin), torch.tensor([softplus(-0.5), softplus(1.0)])
    )


PI_C, PI_R = torch.tensor([-1.0]), torch.tensor([-2.0])
REF_C, REF_R = torch.tensor([-1.5]), torch.tensor([-1.5])  # z = (-1 + 2) - 0 = 1


def test_dpo_and_cdpo_by_hand():
    loss, chosen_reward, rejected_reward = DPO_LOSSES["sigmoid"](PI_C, PI_R, REF_C, REF_R, beta=0.5)
    assert_close(loss, torch.tensor([softplus(-0.5)]))
    assert_close(chosen_reward, torch.tensor([0.25]))
    assert_close(rejected_reward, torch.tensor([-0.25]))
    smoothed, _, _ = DPO_LOSSES["sigmoid"](PI_C, PI_R, REF_C, REF_R, beta=0.5, label_smoothing=0.1)
    assert_close(smoothed, torch.tensor([0.9 * softplus(-0.5) + 0.1 * softplus(0.5)]))


def test_ipo_by_hand():
    assert_close(DPO_LOSSES["ipo"](PI_C, PI_R, REF_C, REF_R, beta=0.5)[0], torch.tensor([0.0]))  # (1 - 1)^2
    assert_close(DPO_LOSSES["ipo"](PI_C, PI_R, REF_C, REF_R, beta=0.25)[0], torch.tensor([1.0]))  # (1 - 2)^2


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = PI_C.clone().requires_grad_(), PI_R.clone().requires_grad_()
    loss, reward_c, _ = DPO_LOSSES["sigmoid"](chosen, rejected, REF_C, REF_R, beta=0.5)
    g_c, g_r = torch.autograd.grad(loss.sum(), (chosen, rejected))
    sigma = 1 / (1 + math.exp(0.5))  # d/dz of -log sigmoid(beta z) = -beta * sigmoid(-beta z)
    assert_close(g_c, torch.tensor([-0.5 * sigma]))
    assert_close(g_r, torch.tensor([0.5 * sigma]))
    assert not reward_c.requires_grad


def test_kto_by_hand():
    policy, ref = torch.tensor([-1.0, -1.0]), torch.tensor([-1.5, -1.5])  # logratio 0.5
    kl = torch.tensor(0.2)
    loss, rewards = kto_loss(policy, ref, torch.tensor([True, False]), kl, beta=1.0, undesirable_weight=2.0)
    sig = 1 / (1 + math.exp(-0.3))
    assert_close(loss, torch.tensor([1 - sig, 2.0 * sig]))
    assert_close(rewards, torch.tensor([0.5, 0.5]))


def test_kto_kl_estimate_is_detached_and_clamped():
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert kto_kl_estimate(policy, torch.tensor([-1.5, -1.0])).item() == 0.0  # mean(0.5, -1) < 0
    kl = kto_kl_estimate(policy, torch.tensor([-1.5, -2.3]))
    assert_close(kl, torch.tensor(0.4))
    assert not kl.requires_grad
