"""OpenRLHF v0.9.2's PPO flags that tidal honours as v0.9.2 does: ``--no_advantage_std_norm`` (centre,
do not scale), ``--stop_properly_penalty_coef`` (truncated samples' rewards scaled), ``--enable_ema``
/ ``--ema_beta`` (an EMA of the policy, saved at the end) and ``--ptx_coef`` with ``--pretrain_data``
(a next-token loss on pretraining text mixed into the policy update). Hand-computed where it is math."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.advantages import masked_centre
from tidal.algorithms.rewards import stop_properly_penalty
from tidal.cli.train_ppo import parse_run
from tidal.config.args import ConfigError
from tidal.config.rl import AlgorithmConfig
from tidal.experience.experience import Experience
from tidal.experience.maker import add_advantages, from_trajectories, shape_rewards


def _experience(rewards: torch.Tensor, width: int = 3, truncated=None) -> Experience:
    """Rows of ``width`` tokens: one prompt token, then action tokens."""
    n = rewards.numel()
    ones = torch.ones(n, width, dtype=torch.long)
    mask = ones.clone()
    mask[:, 0] = 0
    zeros = torch.zeros(n, width)
    return Experience(ones, ones, mask, zeros, rewards=rewards.clone(), scores=rewards.clone(),
                      old_logprobs=zeros.clone(), truncated=truncated)  # fmt: skip


# ---- --no_advantage_std_norm ---------------------------------------------------------------------
def test_masked_centre_subtracts_the_masked_mean_only():
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # mean of 1, 2, 3 = 2; masked entries become 0
    assert_close(masked_centre(x, mask), torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))


def test_no_advantage_std_norm_centres_reinforce_advantages():
    """REINFORCE (γ=1): both action tokens of a row carry its reward R; the batch mean of R over the
    action tokens is 0.5, so the advantages are R − 0.5 — not divided by the std (2.06)."""
    rewards = torch.tensor([0.0, 1.0, 3.0, -2.0])
    cfg = AlgorithmConfig(advantage_estimator="reinforce", no_advantage_std_norm=True)
    exp = add_advantages(_experience(rewards), cfg, 1, kl_coef=0.0)
    expected = torch.tensor([-0.5, 0.5, 2.5, -2.5])[:, None] * torch.tensor([[0.0, 1.0, 1.0]])
    assert_close(exp.advantages, expected)
    whitened = add_advantages(_experience(rewards), AlgorithmConfig(advantage_estimator="reinforce"), 1, 0.0)
    assert_close(whitened.advantages, expected / expected[:, 1:].std(unbiased=False), atol=1e-5, rtol=1e-5)


def test_no_advantage_std_norm_is_refused_where_nothing_is_normalised():
    with pytest.raises(ConfigError, match="--no_advantage_std_norm: --advantage_estimator group_norm"):
        AlgorithmConfig(advantage_estimator="group_norm", no_advantage_std_norm=True)
    assert AlgorithmConfig(advantage_estimator="gae", no_advantage_std_norm=True).problems() == []


# ---- --stop_properly_penalty_coef ----------------------------------------------------------------
def test_stop_properly_penalty_scales_truncated_rewards():
    rewards = torch.tensor([1.0, -2.0, 3.0, 0.5])
    truncated = torch.tensor([True, True, False, False])
    assert_close(stop_properly_penalty(rewards, truncated, 0.5), torch.tensor([0.5, -1.0, 3.0, 0.5]))
    assert_close(stop_properly_penalty(rewards, truncated, 0.0), torch.tensor([0.0, 0.0, 3.0, 0.5]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stop_properly_penalty(rewards, truncated, 1.5)


def test_stop_properly_penalty_comes_after_the_overlong_penalty():
    """v0.9.2's order: reward 3, overlong penalty −1 (2 action tokens of at most 2, buffer 1) → 2,
    then truncated × 0.5 → 1 (the other order would give 0.5). An untruncated sample keeps 3 − 1."""
    cfg = AlgorithmConfig(overlong_buffer_len=1, stop_properly_penalty_coef=0.5)
    exp = _experience(torch.tensor([3.0, 3.0]), truncated=torch.tensor([True, False]))
    assert_close(shape_rewards(exp, cfg, max_new_tokens=2, moments=None), torch.tensor([1.0, 2.0]))
    off = AlgorithmConfig(overlong_buffer_len=1)
    assert_close(shape_rewards(exp, off, max_new_tokens=2, moments=None), torch.tensor([2.0, 2.0]))


def test_trajectories_record_which_samples_were_cut_at_the_limit():
    def traj(reason):
        return SimpleNamespace(token_ids=[1, 2, 3], action_mask=[0, 1, 1], rollout_logprobs=[0.0] * 3,
                               reward=1.0, score=None, finish_reason=reason)  # fmt: skip

    exp = from_trajectories([traj("length"), traj("stop"), traj("done")], pad_id=0)
    assert exp.truncated.tolist() == [True, False, False]
    assert exp.select([0, 2]).truncated.tolist() == [True, False]
    assert Experience.concat([exp, exp]).truncated.tolist() == [True, False, False] * 2


# ---- flags → configs -----------------------------------------------------------------------------
def _ppo_flags(*extra):
    return ["--pretrain", "m", "--prompt_data", "d", *extra]


def test_flags_parse_into_the_algorithm_config():
    run = parse_run(_ppo_flags("--no_advantage_std_norm", "--stop_properly_penalty_coef", "0.3"))
    assert run.algorithm.no_advantage_std_norm and run.algorithm.stop_properly_penalty_coef == 0.3
    default = parse_run(_ppo_flags())
    assert (
        not default.algorithm.no_advantage_std_norm and default.algorithm.stop_properly_penalty_coef is None
    )


def test_stop_properly_penalty_coef_outside_unit_interval_is_refused():
    with pytest.raises(ConfigError, match=r"--stop_properly_penalty_coef must be in \[0, 1\], got 2"):
        parse_run(_ppo_flags("--stop_properly_penalty_coef", "2"))
