"""Rollout/trainer mismatch correction: TIS truncation and ICEPOP masking."""

import math

import torch
from torch.testing import assert_close

from tidal.algorithms.correction import MISMATCH_CORRECTIONS, icepop_weights, tis_weights

# w = exp(old - rollout) = [0.3, 1.0, 3.0, 8.0]; the last token is padding
OLD = torch.tensor([[math.log(0.3), 0.0, math.log(3.0), math.log(8.0)]], requires_grad=True)
ROLLOUT = torch.zeros(1, 4)
MASK = torch.tensor([[1, 1, 1, 0]])


def test_registry_keys():
    assert set(MISMATCH_CORRECTIONS) == {"tis", "icepop"}


def test_tis_truncates():
    weights, stats = tis_weights(OLD, ROLLOUT, MASK, low=0.0, high=2.0)
    assert_close(weights, torch.tensor([[0.3, 1.0, 2.0, 0.0]]))
    assert_close(stats["mismatch_clip_ratio"], torch.tensor(1 / 3))
    assert_close(stats["mismatch_weight"], torch.tensor((0.3 + 1.0 + 3.0) / 3))
    both, _ = tis_weights(OLD, ROLLOUT, MASK, low=0.5, high=2.0)
    assert_close(both, torch.tensor([[0.5, 1.0, 2.0, 0.0]]))


def test_icepop_masks_outside_the_band():
    weights, stats = icepop_weights(OLD, ROLLOUT, MASK, low=0.5, high=5.0)
    assert_close(weights, torch.tensor([[0.0, 1.0, 3.0, 0.0]]))
    assert_close(stats["mismatch_clip_ratio"], torch.tensor(1 / 3))


def test_weights_are_detached_and_zero_the_loss_of_masked_tokens():
    logp = torch.zeros(1, 4, requires_grad=True)

    def per_token_loss():
        return -(logp.exp() * torch.tensor([[1.0, 2.0, 3.0, 4.0]]))

    for fn in MISMATCH_CORRECTIONS.values():
        weights, _ = fn(OLD, ROLLOUT, MASK, 0.5, 2.5)
        assert not weights.requires_grad
        (grad,) = torch.autograd.grad((per_token_loss() * weights).sum(), logp)
        assert grad[0, 3].item() == 0.0
    weights, _ = icepop_weights(OLD, ROLLOUT, MASK, 0.5, 2.5)
    (grad,) = torch.autograd.grad((per_token_loss() * weights).sum(), logp)
    assert_close(grad, torch.tensor([[0.0, -2.0, 0.0, 0.0]]))  # 0.3 and 3.0 fall outside [0.5, 2.5]
    weights, _ = tis_weights(OLD, ROLLOUT, MASK, 0.5, 2.5)
    (grad,) = torch.autograd.grad((per_token_loss() * weights).sum(), logp)
    assert_close(grad, torch.tensor([[-0.5, -2.0, -7.5, 0.0]]))  # clamped to 0.5, 1, 2.5
