"""Reward shaping: KL-in-reward, normalisation, DAPO overlong penalty and dynamic filtering."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.rewards import (
    RunningMoments,
    dynamic_filter_mask,
    kl_penalized_rewards,
    last_action_index,
    normalize_rewards,
    overlong_penalty,
)


def test_last_action_index_right_left_holes_and_empty():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    assert last_action_index(mask).tolist() == [1, 3, 3, 2, 0]
    assert last_action_index(mask.bool()).tolist() == [1, 3, 3, 2, 0]


def test_kl_penalized_rewards_by_hand():
    rewards = torch.tensor([1.0, -2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right- and left-aligned
    out = kl_penalized_rewards(rewards, kl, mask, kl_coef=0.5)
    assert_close(out, torch.tensor([[-0.05, -0.1 + 1.0, 0.0], [0.0, -0.25, -0.3 - 2.0]]))
    clipped = kl_penalized_rewards(rewards, kl, mask, kl_coef=0.5, reward_clip_range=(-1.5, 0.5))
    assert_close(clipped[0, 1], torch.tensor(-0.1 + 0.5))
    assert_close(clipped[1, 2], torch.tensor(-0.3 - 1.5))
    assert_close(kl_penalized_rewards(rewards, None, mask), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]))


def test_kl_penalized_rewards_empty_row_gets_nothing():
    out = kl_penalized_rewards(torch.tensor([3.0]), torch.ones(1, 2), torch.zeros(1, 2), kl_coef=1.0)
    assert out.abs().sum().item() == 0.0


def test_normalize_rewards_batch():
    s = math.sqrt(2.0 / 3.0)  # population std of 1, 2, 3
    assert_close(normalize_rewards(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([-1 / s, 0.0, 1 / s]))


def test_running_moments_merge_batches():
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0]))
    moments.update(torch.tensor([3.0, 4.0, 5.0]))
    assert moments.count == 5
    assert moments.mean == pytest.approx(3.0)
    assert moments.var == pytest.approx(2.0)  # population variance of 1..5
    assert_close(moments.normalize(torch.tensor([5.0])), torch.tensor([2.0 / math.sqrt(2.0)]))


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([5, 6, 7, 9, 10, 12])
    # max_new 10, buffer 4: free up to 6, then -excess/4, capped at -1
    expected = torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    assert_close(overlong_penalty(lengths, 10, 4), expected)
    assert_close(overlong_penalty(lengths, 10, 4, penalty_factor=0.5), expected * 0.5)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 10, 0)


def test_dynamic_filter_drops_all_right_and_all_wrong_groups():
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    keep = dynamic_filter_mask(scores, 3)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert dynamic_filter_mask(scores, 3, low=0.5).tolist() == [False] * 9 + [True] * 3
    with pytest.raises(ValueError, match="groups"):
        dynamic_filter_mask(scores, 5)
