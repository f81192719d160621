"""Clipped value loss and entropy from logits."""

import math

import torch
from torch.testing import assert_close

from tidal.algorithms.logprobs import entropy_from_logits
from tidal.algorithms.value_loss import value_loss

V = torch.tensor([[1.0, 2.0, 0.0, 5.0]])
V_OLD = torch.tensor([[0.5, 2.0, 0.5, 0.0]])
G = torch.tensor([[1.5, 1.0, 1.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0]])


def test_value_loss_clipped_by_hand():
    loss, stats = value_loss(V, V_OLD, G, MASK, clip_eps=0.2)
    # t0: max((1-1.5)^2, (0.7-1.5)^2) = .64; t1: max(1, 1) = 1; t2: max(1, (0.3-1)^2) = 1
    assert_close(loss, torch.tensor([[0.32, 0.5, 0.5, 0.0]]))
    assert_close(stats["value_clip_ratio"], torch.tensor(1 / 3))


def test_value_loss_unclipped_by_hand_and_gradient():
    values = V.clone().requires_grad_()
    loss, _ = value_loss(values, V_OLD, G, MASK)
    assert_close(loss, torch.tensor([[0.125, 0.5, 0.5, 0.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), values)
    assert_close(grad, torch.tensor([[-0.5, 1.0, -1.0, 0.0]]))  # V - G on action tokens


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [1000.0, 0.0]]])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), torch.tensor([[math.log(2.0), h, 0.0]]))
    hot = torch.tensor([[[0.0, 2 * math.log(3.0)]]])
    assert_close(entropy_from_logits(hot, temperature=2.0), torch.tensor([[h]]))


def test_entropy_chunked_matches_whole_and_is_bounded():
    logits = torch.randn(2, 7, 11, generator=torch.Generator().manual_seed(6)) * 4
    whole = entropy_from_logits(logits)
    assert_close(entropy_from_logits(logits, chunk_size=3), whole)
    assert (whole >= 0).all() and (whole <= math.log(11) + 1e-6).all()
