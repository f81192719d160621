"""PPO and GSPO clipped surrogate losses, and each loss's default aggregation."""

import argparse
import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.correction import corrected_policy_loss
from tidal.algorithms.masked import aggregate_loss
from tidal.algorithms.policy_loss import (
    DEFAULT_AGGREGATION,
    POLICY_LOSSES,
    ClipParams,
    gspo_policy_loss,
    loss_aggregation,
    ppo_policy_loss,
)
from tidal.config.args import add_config_group, config_from_args
from tidal.config.rl import AlgorithmConfig

RATIOS = [1.5, 0.5, 1.0]
ADV = torch.tensor([[1.0, -1.0, 2.0]])
MASK = torch.ones(1, 3)


def logp_for(ratios):
    return torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)


def test_registry_keys():
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "cispo", "sapo"}


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
        loss, _ = loss_fn(logp, old, torch.tensor([[1.0, 1.0]]), mask, 0.2, 0.2)  # ε, or SAPO's τ
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


# ---- GSPO's aggregation: the per-sequence mean by default, as OpenRLHF (issue #38) ----------------


def openrlhf_gspo(logp, old, adv, mask, eps_low, eps_high):
    """The reference: OpenRLHF's PolicyLoss for GSPO written out. One ratio per sequence, exp of the
    masked mean log-ratio, on every token; −min of the two surrogates; then always the mean over the
    non-empty sequences of their token means (it sets token_level_loss=False for GSPO)."""
    m = mask.float()
    lengths = m.sum(-1)
    s = torch.exp(((logp - old) * m).sum(-1) / lengths.clamp(min=1)).unsqueeze(-1)
    per_token = -torch.min(s * adv, s.clamp(1 - eps_low, 1 + eps_high) * adv)
    per_sequence = (per_token * m).sum(-1) / lengths.clamp(min=1)
    return per_sequence[lengths > 0].mean()


def test_each_loss_declares_its_default_aggregation():
    assert DEFAULT_AGGREGATION == {"ppo": "token", "gspo": "sequence", "cispo": "token", "sapo": "sequence"}
    assert set(DEFAULT_AGGREGATION) == set(POLICY_LOSSES)
    assert loss_aggregation("gspo") == "sequence" and loss_aggregation("ppo") == "token"
    assert loss_aggregation("gspo", "token") == "token"  # an explicit --loss_agg_mode wins
    assert AlgorithmConfig().loss_aggregation == "token"
    assert AlgorithmConfig(policy_loss_type="gspo").loss_aggregation == "sequence"
    tis = AlgorithmConfig(policy_loss_type="gspo", enable_vllm_is_correction=True)
    assert tis.loss_aggregation == "sequence"
    assert AlgorithmConfig(policy_loss_type="gspo", loss_agg_mode="token").loss_aggregation == "token"
    assert AlgorithmConfig(loss_agg_mode="sequence").loss_aggregation == "sequence"


def test_the_flag_unset_means_the_loss_default_and_given_means_that_mode():
    parser = argparse.ArgumentParser()
    add_config_group(parser, AlgorithmConfig, "algorithm")
    gspo = config_from_args(AlgorithmConfig, parser.parse_args(["--policy_loss_type", "gspo"]))
    assert gspo.loss_agg_mode is None and gspo.loss_aggregation == "sequence"
    token = parser.parse_args(["--policy_loss_type", "gspo", "--loss_agg_mode", "token"])
    assert config_from_args(AlgorithmConfig, token).loss_aggregation == "token"


def test_gspo_default_aggregation_by_hand():
    # the rows of test_gspo_sequence_ratio_by_hand: per-token loss [[-s0, -s0], [s1, (masked)]]
    logp = torch.tensor([[0.2, -0.1], [0.3, 7.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    per_token, _ = gspo_policy_loss(logp, torch.zeros(2, 2), adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    s0, s1 = math.exp(0.05), math.exp(0.3)
    default = aggregate_loss(per_token, mask, loss_aggregation("gspo"))
    assert_close(default, torch.tensor((-s0 + s1) / 2))  # each sequence weighs 1/2
    token = aggregate_loss(per_token, mask, "token")
    assert_close(token, torch.tensor((-2 * s0 + s1) / 3))  # the 2-token sequence weighs 2/3
    reference = openrlhf_gspo(logp, torch.zeros(2, 2), adv, mask, 0.2, 0.2)
    assert_close(default, reference)
    assert abs(float(token - reference)) > 0.1


def _gspo_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(6, 9, generator=gen) * 0.3).requires_grad_()
    old = torch.randn(6, 9, generator=gen) * 0.3
    rollout = old + torch.randn(6, 9, generator=gen) * 0.05
    adv = torch.randn(6, 1, generator=gen).expand(6, 9)  # one advantage per sequence (GRPO)
    lengths = torch.tensor([9, 2, 5, 7, 1, 4])
    mask = torch.arange(9) < lengths[:, None]
    return logp, old, rollout, adv, mask


@pytest.mark.parametrize("correction", [None, "tis"])
def test_gspo_default_equals_openrlhf_loss_and_gradient(correction):
    """OpenRLHF's GSPO loss and gradient, plain and with the mismatch correction (its ratio then takes
    the rollout engine's log-probs), on unequal lengths where token and sequence means differ."""
    logp, old, rollout, adv, mask = _gspo_inputs(7)
    eps = (0.2, 0.28)
    per_token, _ = corrected_policy_loss("gspo", logp, old, adv, mask, ClipParams(*eps), rollout, correction)
    loss = aggregate_loss(per_token, mask, loss_aggregation("gspo"))
    (grad,) = torch.autograd.grad(loss, logp)
    reference = openrlhf_gspo(logp, old if correction is None else rollout, adv, mask, *eps)
    (ref_grad,) = torch.autograd.grad(reference, logp)
    assert_close(loss, reference)
    assert_close(grad, ref_grad)
    # the token mean, the former default, is a different objective on these rows
    token = aggregate_loss(per_token, mask, "token")
    assert abs(float((token - reference).detach())) > 1e-2
