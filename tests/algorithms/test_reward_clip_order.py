"""``--reward_clip_range`` clips the shaped reward *after* the group baseline (OpenRLHF's order), and
the trainer's one-process and multi-process paths both use ``estimate_advantages``'s semantics."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.trainers.experiences import reward_rows
from tidal.algorithms import estimate_advantages
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.world import World
from tidal.experience.experience import Experience
from tidal.experience.maker import BatchReduction, add_advantages, shape_rewards

# RLOO on [0, 0, 0, 20] with n=4: shaped = R_i − mean(others) = [−6.67, −6.67, −6.67, 20] → clip 10.
RAW = torch.tensor([0.0, 0.0, 0.0, 20.0])
EXPECTED = torch.tensor([-20 / 3, -20 / 3, -20 / 3, 10.0])


def _trainer_advantages(rewards, cfg: AlgorithmConfig, n: int, world: World) -> Experience:
    """The trainer's steps: ``shape_rewards`` then ``add_advantages`` with the world's reduction."""
    exp = reward_rows(rewards)
    exp.rewards = shape_rewards(exp, cfg, max_new_tokens=2, moments=None)
    return add_advantages(exp, cfg, n, kl_coef=0.0, reduction=BatchReduction.over(world))


def test_estimate_advantages_clips_after_the_rloo_baseline():
    exp = reward_rows(RAW)
    adv, _, token_rewards = estimate_advantages(
        "rloo", RAW, exp.action_mask, 4, reward_clip_range=(-10.0, 10.0)
    )
    assert_close(token_rewards[:, -1], EXPECTED)
    assert_close(adv[:, 1], EXPECTED)  # γ = 1: every action token carries the terminal reward


def test_trainer_path_clips_after_the_baseline_like_estimate_advantages():
    cfg = AlgorithmConfig(advantage_estimator="rloo", reward_clip_range=(-10.0, 10.0))
    exp = _trainer_advantages(RAW, cfg, 4, World())
    assert_close(exp.advantages[:, -1], EXPECTED)  # was [-3.33, -3.33, -3.33, 10]: clip before baseline
    assert_close(exp.advantages[:, 0], torch.zeros(4))  # prompt token


def test_trainer_path_matches_estimate_advantages_with_whitening():
    """reinforce_baseline: mean baseline [-5, -5, -5, 15] → clip 10 → whitened over the batch."""
    cfg = AlgorithmConfig(advantage_estimator="reinforce_baseline", reward_clip_range=(-10.0, 10.0))
    rewards = torch.tensor([0.0, 0.0, 0.0, 20.0, 1.0, 2.0, 3.0, -30.0])
    exp = _trainer_advantages(rewards, cfg, 4, World())
    expected, _, token_rewards = estimate_advantages(
        "reinforce_baseline", rewards, exp.action_mask, 4, reward_clip_range=(-10.0, 10.0)
    )
    assert_close(token_rewards[:4, -1], torch.tensor([-5.0, -5.0, -5.0, 10.0]))
    assert_close(exp.advantages, expected)


@pytest.fixture
def gloo_group(tmp_path):
    """A one-process gloo group, so the all-process collectives of the multi-process path really run."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_multi_process_path_clips_after_the_baseline_and_whitens_over_the_world(gloo_group):
    """The ``world.distributed`` branch (whitening by all-reduce) on one real process: a World that
    claims 2 ranks makes it take that branch, the 1-process group makes its sums those of the batch."""
    cfg = AlgorithmConfig(advantage_estimator="reinforce_baseline", reward_clip_range=(-10.0, 10.0))
    rewards = torch.tensor([0.0, 0.0, 0.0, 20.0, 1.0, 2.0, 3.0, -30.0])
    exp = _trainer_advantages(rewards, cfg, 4, World(rank=0, world_size=2))
    expected, _, _ = estimate_advantages(
        "reinforce_baseline", rewards, exp.action_mask, 4, reward_clip_range=(-10.0, 10.0)
    )
    assert_close(exp.advantages, expected)
    rloo = AlgorithmConfig(advantage_estimator="rloo", reward_clip_range=(-10.0, 10.0))
    assert_close(_trainer_advantages(RAW, rloo, 4, World(rank=0, world_size=2)).advantages[:, -1], EXPECTED)
