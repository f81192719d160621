"""Group baselines, GAE, discounted returns and the advantage-estimator registry."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    discounted_returns,
    estimate_advantages,
    gae_advantages_and_returns,
)
from tidal.algorithms.masked import masked_mean, masked_var

R = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])  # two prompts, n = 3


def baseline(name, rewards, n):
    return ADVANTAGE_ESTIMATORS[name].baseline(rewards, n)


def test_registry_keys_and_facts():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae",
        "reinforce",
        "reinforce_baseline",
        "rloo",
        "group_norm",
        "dr_grpo",
    }
    whitened = {name for name, est in ADVANTAGE_ESTIMATORS.items() if est.whiten}
    assert whitened == {"gae", "reinforce", "reinforce_baseline"}
    assert {name for name, est in ADVANTAGE_ESTIMATORS.items() if est.needs_critic} == {"gae"}


def test_group_baselines_by_hand():
    assert_close(baseline("gae", R, 3), R)
    assert_close(baseline("reinforce", R, 3), R)
    centred = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    assert_close(baseline("reinforce_baseline", R, 3), centred)
    assert_close(baseline("dr_grpo", R, 3), centred)
    # rloo: 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2
    assert_close(baseline("rloo", R, 3), torch.tensor([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]))
    # group 1 has unbiased std 1
    assert_close(baseline("group_norm", R, 3), centred)


def test_group_norm_uses_unbiased_std():
    # [0, 1]: mean 0.5, unbiased std sqrt(0.5) (population std would give +-1)
    half = 0.5 / math.sqrt(0.5)
    assert_close(baseline("group_norm", torch.tensor([0.0, 1.0]), 2), torch.tensor([-half, half]))


def test_group_norm_of_constant_group_is_zero():
    assert baseline("group_norm", torch.tensor([3.0, 3.0, 3.0, 3.0]), 4).abs().max().item() == 0.0


def test_rloo_baseline_excludes_self():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(8, generator=gen)
    base = rewards - baseline("rloo", rewards, 4)
    bumped = rewards.clone()
    bumped[0] += 10.0
    # sample 0's baseline does not move when its own reward does; its group mates' do
    assert_close((bumped - baseline("rloo", bumped, 4))[0], base[0])
    assert not torch.allclose((bumped - baseline("rloo", bumped, 4))[1:4], base[1:4])
    # identity: rloo = n/(n-1) * (R - mean)
    assert_close(baseline("rloo", rewards, 4), 4 / 3 * baseline("reinforce_baseline", rewards, 4))


@pytest.mark.parametrize("name", ["rloo", "group_norm"])
def test_groups_of_one_fail_clearly(name):
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        baseline(name, R, 1)


def test_gae_by_hand_right_left_and_holes():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [9.0, 0.0, 1.0], [0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [9.0, 0.6, 0.7], [0.5, 99.0, 0.7]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 0, 1]])
    adv, ret = gae_advantages_and_returns(rewards, mask, values, gamma=0.9, lambd=0.8)
    # row 0: d2 = 1 - .7 = .3; d1 = .9*.7 - .6 = .03, A1 = .03 + .72*.3; d0 = .9*.6 - .5 = .04, A0 = .04 + .72*A1
    a1 = 0.03 + 0.72 * 0.3
    a0 = 0.04 + 0.72 * a1
    # row 2: the hole is skipped, V_next of token 0 is token 2's value: d0 = .9*.7 - .5 = .13
    a0_hole = 0.13 + 0.72 * 0.3
    expected_adv = torch.tensor([[a0, a1, 0.3], [0.0, a1, 0.3], [a0_hole, 0.0, 0.3]])
    assert_close(adv, expected_adv)
    assert_close(
        ret, torch.tensor([[a0 + 0.5, a1 + 0.6, 1.0], [0.0, a1 + 0.6, 1.0], [a0_hole + 0.5, 0.0, 1.0]])
    )


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    gen = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 1]])
    adv, ret = gae_advantages_and_returns(rewards, mask, values, gamma=1.0, lambd=1.0)
    returns, _ = discounted_returns(rewards, mask, gamma=1.0)
    assert_close(adv, (returns - values) * mask)
    assert_close(ret, returns)


def test_gae_lambda_zero_is_one_step_td():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 1.0, 2.0]])
    adv, _ = gae_advantages_and_returns(rewards, torch.ones(1, 3), values, gamma=0.5, lambd=0.0)
    assert_close(adv, torch.tensor([[1.0 + 0.5 - 0.5, 2.0 + 1.0 - 1.0, 3.0 - 2.0]]))


def test_gae_output_carries_no_gradient():
    values = torch.ones(1, 2, requires_grad=True)
    adv, ret = gae_advantages_and_returns(torch.ones(1, 2), torch.ones(1, 2), values)
    assert not adv.requires_grad and not ret.requires_grad


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[1.0, 2.0, 4.0], [1.0, 7.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    adv, ret = discounted_returns(rewards, mask, gamma=0.5)
    assert_close(adv, torch.tensor([[1 + 0.5 * 4, 2 + 0.5 * 4, 4.0], [1 + 0.5 * 4, 0.0, 4.0]]))
    assert_close(ret, adv)
    adv1, _ = discounted_returns(rewards, mask, gamma=1.0)
    assert_close(adv1, torch.tensor([[7.0, 6.0, 4.0], [5.0, 0.0, 4.0]]))


def test_discounted_returns_fast_path_matches_loop():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(4, 7, generator=gen)
    mask = torch.rand(4, 7, generator=gen) > 0.3
    fast, _ = discounted_returns(rewards, mask, gamma=1.0)
    loop, _ = discounted_returns(rewards, mask, gamma=1.0 - 1e-7)
    assert_close(fast, loop, atol=1e-5, rtol=1e-5)


def test_estimate_advantages_group_norm_end_to_end():
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, ret, token_rewards = estimate_advantages("group_norm", torch.tensor([0.0, 1.0]), mask, 2)
    half = 0.5 / math.sqrt(0.5)
    assert_close(token_rewards, torch.tensor([[0.0, -half], [half, 0.0]]))
    assert_close(adv, torch.tensor([[-half, -half], [half, 0.0]]))  # not whitened
    assert_close(ret, adv)


def test_estimate_advantages_kl_in_reward_then_reinforce_whitening():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.2, 0.4, 0.0], [0.2, 0.2, 0.0]])
    _, ret, token_rewards = estimate_advantages(
        "reinforce", torch.tensor([1.0, 0.0]), mask, 1, kl, kl_coef=0.5
    )
    assert_close(token_rewards, torch.tensor([[-0.1, -0.2, 1.0], [-0.1, -0.1, 0.0]]))
    assert_close(ret, torch.tensor([[0.7, 0.8, 1.0], [-0.2, -0.1, 0.0]]))
    adv, _, _ = estimate_advantages(
        "reinforce_baseline", torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.ones(4, 2), 2
    )
    assert abs(masked_mean(adv, torch.ones(4, 2)).item()) < 1e-6
    assert_close(masked_var(adv, torch.ones(4, 2)), torch.tensor(1.0), atol=1e-5, rtol=1e-5)


def test_estimate_advantages_gae_needs_values():
    with pytest.raises(ValueError, match="critic"):
        estimate_advantages("gae", torch.tensor([1.0]), torch.ones(1, 2), 1)


@pytest.mark.parametrize("estimator", ["rloo", "group_norm", "dr_grpo", "reinforce_baseline"])
def test_gamma_below_one_is_refused_where_returns_are_undiscounted(estimator):
    """OpenRLHF forces γ = 1 for the group-baseline estimators; tidal refuses instead of ignoring --gamma."""
    from tidal.config import ConfigError
    from tidal.config.rl import AlgorithmConfig

    with pytest.raises(ConfigError, match=rf"--gamma 0.9: --advantage_estimator {estimator} is undiscounted"):
        AlgorithmConfig(advantage_estimator=estimator, gamma=0.9)
    for discounted in ("gae", "reinforce"):
        assert AlgorithmConfig(advantage_estimator=discounted, gamma=0.9).gamma == 0.9


def test_estimator_facts_live_on_the_registry_entry():
    grouped = {name for name, est in ADVANTAGE_ESTIMATORS.items() if est.grouped}
    assert grouped == {"rloo", "reinforce_baseline", "group_norm", "dr_grpo"}
    assert {name for name, est in ADVANTAGE_ESTIMATORS.items() if est.discounted} == {"gae", "reinforce"}


def test_a_new_estimator_is_one_decorated_function(monkeypatch):
    from tidal.algorithms import advantages

    monkeypatch.setattr(advantages, "ADVANTAGE_ESTIMATORS", dict(ADVANTAGE_ESTIMATORS))

    @advantages.advantage_estimator("max_baseline", advantages.discounted_returns, whiten=False, grouped=True)
    def max_baseline(rewards, n):
        groups = rewards.float().view(-1, n)
        return (groups - groups.max(dim=-1, keepdim=True).values).reshape(-1)

    mask = torch.ones(4, 2)
    adv, _, _ = advantages.estimate_advantages("max_baseline", torch.tensor([1.0, 3.0, 2.0, 2.0]), mask, 2)
    assert adv[:, -1].tolist() == [-2.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="registered twice"):
        advantages.advantage_estimator("max_baseline", advantages.discounted_returns, whiten=False)(
            max_baseline
        )


def openrlhf_gae(rewards, values, mask, gamma, lambd):
    """The reference: OpenRLHF's GAE, which zeroes rewards and values off the action mask and runs the
    recursion over every position, so a multi-turn gap is a step of reward 0 and value 0."""
    rewards, values = rewards * mask, values * mask
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        last = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lambd * last
        advantages[:, t] = last
    return advantages * mask


def test_multi_turn_gaps_are_skipped_undiscounted_a_documented_difference():
    """docs/algorithms.md: a gap in the action mask (an observation between turns) is transparent in
    tidal; OpenRLHF runs the recursion through it. Equal at γ = λ = 1, different below."""
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.0, 0.7]])
    mask = torch.tensor([[1, 0, 1]])
    ours, _ = gae_advantages_and_returns(rewards, mask, values, gamma=0.9, lambd=0.8)
    # tidal: δ0 = 0.9·0.7 − 0.5 = 0.13, A0 = 0.13 + 0.72·0.3 (the hole is skipped)
    assert_close(ours[0, 0], torch.tensor(0.13 + 0.72 * 0.3))
    # OpenRLHF: the hole is a step: A1 = 0.9·0.7 + 0.72·0.3 = 0.846, A0 = −0.5 + 0.72·0.846
    reference = openrlhf_gae(rewards, values, mask, 0.9, 0.8)
    assert_close(reference[0, 0], torch.tensor(-0.5 + 0.72 * (0.63 + 0.72 * 0.3)))
    gen = torch.Generator().manual_seed(6)
    rewards, values = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    mask = torch.tensor(
        [[1, 1, 0, 0, 1, 1, 0, 1], [1] * 8, [1, 0, 1, 0, 1, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    )
    undiscounted, _ = gae_advantages_and_returns(rewards, mask, values, gamma=1.0, lambd=1.0)
    assert_close(undiscounted, openrlhf_gae(rewards, values, mask, 1.0, 1.0))
    discounted, _ = gae_advantages_and_returns(rewards, mask, values, gamma=0.9, lambd=0.95)
    assert_close(discounted[1:2], openrlhf_gae(rewards, values, mask, 0.9, 0.95)[1:2])  # no gap: equal
    assert (discounted - openrlhf_gae(rewards, values, mask, 0.9, 0.95)).abs().max() > 1e-2
