"""The one experience path takes its batch-wide statistics from the ``BatchReduction`` it is given:
the running reward moments see ``gather``'s rewards (every rank's), advantages are whitened with
``whiten``, and one process's reduction is the plain local one."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from tests.trainers.experiences import reward_rows
from tidal.algorithms import masked_whiten
from tidal.algorithms.rewards import RunningMoments
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.world import World
from tidal.experience.maker import LOCAL, BatchReduction, add_advantages, shape_rewards


def test_one_process_reduces_over_its_own_batch():
    assert BatchReduction.over(World()) is LOCAL
    assert LOCAL.whiten is masked_whiten


def test_reward_moments_fold_in_what_the_reduction_gathers():
    """A rank with rewards [0, 1] whose peer holds [10, 11]: both normalise with the moments of all four."""
    other_rank = torch.tensor([10.0, 11.0])
    world = BatchReduction(gather=lambda mine: torch.cat([mine, other_rank]))
    cfg = AlgorithmConfig(advantage_estimator="reinforce")
    mine = torch.tensor([0.0, 1.0])
    moments = RunningMoments()
    shaped = shape_rewards(reward_rows(mine), cfg, max_new_tokens=2, moments=moments, reduction=world)
    everything = torch.cat([mine, other_rank]).double()
    assert moments.count == 4 and abs(moments.mean - float(everything.mean())) < 1e-12
    assert_close(shaped, ((mine - 5.5) / (everything.var(unbiased=False).sqrt() + 1e-8)).float())


def test_advantages_are_whitened_by_the_reduction():
    calls = []

    def whiten(x, mask):
        calls.append(x.shape)
        return masked_whiten(x, mask) * 2  # a stand-in for statistics over other ranks' shares

    cfg = AlgorithmConfig(advantage_estimator="reinforce")
    rewards = torch.tensor([0.0, 1.0, 3.0, -2.0])
    local = add_advantages(reward_rows(rewards), cfg, 1, kl_coef=0.0)
    reduced = add_advantages(
        reward_rows(rewards), cfg, 1, kl_coef=0.0, reduction=BatchReduction(whiten=whiten)
    )
    assert calls == [torch.Size([4, 3])]
    assert_close(reduced.advantages, local.advantages * 2)
    assert_close(reduced.returns, local.returns)  # returns are not whitened
