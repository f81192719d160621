"""Knowledge distillation and process-reward-model losses."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.distill import distillation_cross_entropy, kd_loss
from tidal.algorithms.prm import prm_loss

STUDENT = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # p_s = [.25, .75], [.5, .5]
TEACHER = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]])  # p_t = [.5, .5]
CE_T0 = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))


def test_kd_by_hand():
    labels = torch.tensor([[1, -100]])
    lm = -math.log(0.75)
    assert_close(kd_loss(STUDENT, TEACHER, labels, alpha=0.5), torch.tensor([[0.5 * lm + 0.5 * CE_T0, 0.0]]))
    assert_close(kd_loss(STUDENT, TEACHER, labels, alpha=0.0), torch.tensor([[lm, 0.0]]))
    assert_close(kd_loss(STUDENT, TEACHER, labels, alpha=1.0), torch.tensor([[CE_T0, 0.0]]))


def test_distillation_cross_entropy_is_minimised_by_the_teacher():
    assert_close(distillation_cross_entropy(STUDENT, TEACHER), torch.tensor([[CE_T0, math.log(2.0)]]))
    gen = torch.Generator().manual_seed(8)
    teacher = torch.randn(4, 6, generator=gen)
    at_teacher = distillation_cross_entropy(teacher, teacher)
    assert (distillation_cross_entropy(torch.randn(4, 6, generator=gen), teacher) >= at_teacher - 1e-6).all()


def test_distillation_ignores_vocab_the_student_rules_out():
    student = torch.tensor([[0.0, float("-inf")]], requires_grad=True)
    teacher = torch.tensor([[0.0, float("-inf")]])
    loss = distillation_cross_entropy(student, teacher)
    assert_close(loss, torch.tensor([0.0]))
    (grad,) = torch.autograd.grad(loss.sum(), student)
    assert torch.isfinite(grad).all()


def test_kd_gradient_flows_to_student_only():
    student, teacher = STUDENT.clone().requires_grad_(), TEACHER.clone().requires_grad_()
    loss = kd_loss(student, teacher, torch.tensor([[1, 0]]), alpha=1.0).sum()
    g_s, g_t = torch.autograd.grad(loss, (student, teacher), allow_unused=True)
    assert_close(g_s[0, 0], torch.tensor([0.25 - 0.5, 0.75 - 0.5]))  # p_s - p_t
    assert g_t is None or g_t.abs().sum().item() == 0.0


# vocab of 4, reward tokens are ids 1 ("+") and 2 ("-"); steps end at positions 0 and 2
PRM_LOGITS = torch.tensor(
    [[[5.0, 0.0, math.log(3.0), 5.0], [9.0, 9.0, 9.0, 9.0], [5.0, math.log(3.0), 0.0, 5.0]]]
)
PLACEHOLDERS = torch.tensor([[True, False, True]])
REWARD_IDS = [1, 2]  # step 0: p(+) = .25, step 2: p(+) = .75


def test_prm_hard_labels_by_hand():
    labels = torch.tensor([[0, -100, 0]])  # both steps good
    loss, acc = prm_loss(PRM_LOGITS, PLACEHOLDERS, labels, REWARD_IDS)
    assert_close(loss, torch.tensor((-math.log(0.25) - math.log(0.75)) / 2))
    assert_close(acc, torch.tensor(0.5))
    summed, _ = prm_loss(PRM_LOGITS, PLACEHOLDERS, labels, REWARD_IDS, num_steps=4)
    assert_close(summed, torch.tensor((-math.log(0.25) - math.log(0.75)) / 4))


def test_prm_soft_labels_by_hand():
    labels = torch.tensor([[0.2, 0.0, 1.0]])
    loss, acc = prm_loss(PRM_LOGITS, PLACEHOLDERS, labels, REWARD_IDS)
    step0 = -(0.2 * math.log(0.25) + 0.8 * math.log(0.75))
    step2 = -math.log(0.75)
    assert_close(loss, torch.tensor((step0 + step2) / 2))
    assert_close(acc, torch.tensor(1.0))
    with pytest.raises(ValueError, match="exactly 2"):
        prm_loss(PRM_LOGITS, PLACEHOLDERS, labels, [0, 1, 2])


def test_prm_gradient_only_at_step_positions_and_reward_tokens():
    logits = PRM_LOGITS.clone().requires_grad_()
    loss, _ = prm_loss(logits, PLACEHOLDERS, torch.tensor([[0, 0, 1]]), REWARD_IDS)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[0, 1].abs().sum().item() == 0.0
    assert grad[:, :, [0, 3]].abs().sum().item() == 0.0
    assert_close(grad[0, 0, 1:3], torch.tensor([0.25 - 1.0, 0.75]) / 2)
