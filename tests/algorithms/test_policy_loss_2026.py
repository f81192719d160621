"""CISPO and SAPO (tidal additions) against hand-computed values and gradients, how the mismatch
corrections compose with them, and their flags (choices, defaults, refusals)."""

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
    SapoParams,
    cispo_policy_loss,
    loss_aggregation,
    ppo_policy_loss,
    sapo_policy_loss,
)
from tidal.config.args import ConfigError, add_config_group, config_from_args
from tidal.config.rl import AlgorithmConfig

LOG_HALF, LOG_1_5, LOG_3 = math.log(0.5), math.log(1.5), math.log(3.0)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logp_for(ratios):
    """log π with log π_old = 0, so ρ = the given ratios; position 3 is padding (garbage −inf)."""
    return torch.tensor([[*(math.log(r) for r in ratios), float("-inf")]], requires_grad=True)


OLD = torch.zeros(1, 5)
MASK = torch.tensor([[1, 1, 1, 1, 0]])


# ---- CISPO -------------------------------------------------------------------------------------------


def test_cispo_by_hand_values_gradients_and_stats():
    # ρ = 1.5 (A=1), 0.5 (A=-1), 1.0 (A=2), 3.0 (A=-2); ε_low 0.2, ε_high 0.28: r̂ = 1.28, 0.8, 1, 1.28
    logp = logp_for([1.5, 0.5, 1.0, 3.0])
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0, 5.0]])
    loss, stats = cispo_policy_loss(logp, OLD, adv, MASK, 0.2, 0.28)
    expected = [-1.28 * 1 * LOG_1_5, -0.8 * -1 * LOG_HALF, 0.0, -1.28 * -2 * LOG_3, 0.0]
    assert_close(loss, torch.tensor([expected]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # −r̂·A on every action token: the clipped tokens (0, 1, 3) keep a gradient, padding has none
    assert_close(grad, torch.tensor([[-1.28, 0.8, -2.0, 2.56, 0.0]]))
    assert_close(stats["clip_ratio"], torch.tensor(3 / 4))
    kl = [(r - 1 - math.log(r)) for r in (1.5, 0.5, 1.0, 3.0)]
    assert_close(stats["approx_kl"], torch.tensor(sum(kl) / 4))


def test_cispo_keeps_the_gradient_ppo_clips_away():
    logp = logp_for([1.5, 0.5, 1.0, 3.0])
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0, 0.0]])
    ppo, _ = ppo_policy_loss(logp, OLD, adv, MASK, 0.2, 0.2)
    cispo, _ = cispo_policy_loss(logp, OLD, adv, MASK, 0.2, 0.2)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    (g_cispo,) = torch.autograd.grad(cispo.sum(), logp)
    assert_close(g_ppo, torch.tensor([[0.0, 0.0, -2.0, 0.0, 0.0]]))  # ρA with ρ outside the band: none
    assert_close(g_cispo, torch.tensor([[-1.2, 0.8, -2.0, -1.2, 0.0]]))


def test_cispo_without_a_lower_bound_and_with_old_logprobs():
    """The paper's setting (ε_low ≥ 1: no lower bound); the weight is data: no gradient reaches π
    through it, and log π_old only enters the weight."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-0.5, -1.0, -1.0]])  # ρ = e^-0.5, e^-1, e^0.5
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = cispo_policy_loss(logp, old, adv, mask, 1.0, 0.28)
    w = [math.exp(-0.5), math.exp(-1.0), 1.28]  # below 1: kept; e^0.5 = 1.65 > 1.28: clipped
    assert_close(loss, torch.tensor([[w[0] * 1.0, w[1] * 2.0, w[2] * 0.5]]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, -torch.tensor([w]))
    assert_close(stats["clip_ratio"], torch.tensor(1 / 3))


# ---- SAPO --------------------------------------------------------------------------------------------


def sapo_by_hand(ratio: float, adv: float, tau_pos=1.0, tau_neg=1.05):
    """(loss, d loss / d log π) of one token: −σ(τ(ρ−1))·4/τ·A, and −A·4σ(1−σ)·ρ."""
    tau = tau_pos if adv > 0 else tau_neg
    s = sigmoid(tau * (ratio - 1.0))
    return -s * 4.0 / tau * adv, -adv * 4.0 * s * (1.0 - s) * ratio


def test_sapo_gate_values_for_each_sign():
    # the numbers written out: σ(0.5) = 0.622459, σ(-0.525) = 0.371684
    loss, _ = sapo_policy_loss(
        logp_for([1.5, 0.5, 1.0, 1.0]), OLD, torch.tensor([[1.0, -1.0, 2.0, 0.0, 1.0]]), MASK
    )
    assert_close(loss, torch.tensor([[-2.489836, 1.415940, -4.0, 0.0, 0.0]]), atol=2e-6, rtol=0)


def test_sapo_by_hand_values_gradients_and_gate_weight():
    ratios, advs = [1.5, 0.5, 1.0, 3.0], [1.0, -1.0, 2.0, -2.0]
    logp = logp_for(ratios)
    adv = torch.tensor([[*advs, 7.0]])
    loss, stats = sapo_policy_loss(logp, OLD, adv, MASK)
    by_hand = [sapo_by_hand(r, a) for r, a in zip(ratios, advs, strict=True)]
    assert_close(loss, torch.tensor([[*(v for v, _ in by_hand), 0.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, torch.tensor([[*(g for _, g in by_hand), 0.0]]))
    # token 3 (ρ = 3, far outside any clip band) keeps a damped gradient: w = 4σ(2.1)(1−σ(2.1)) ≈ 0.39
    weights = []
    for r, a in zip(ratios, advs, strict=True):
        s = sigmoid((1.0 if a > 0 else 1.05) * (r - 1))
        weights.append(4 * s * (1 - s))
    assert 0.3 < weights[3] < 0.5
    assert_close(stats["gate_weight"], torch.tensor(sum(weights) / 4))


def test_sapo_temperatures_are_per_sign_and_sharper_gates_fade_faster():
    logp = logp_for([2.0, 2.0, 1.0, 1.0])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0]])
    loss, _ = sapo_policy_loss(logp, OLD, adv, MASK, 0.5, 4.0)
    expected = [
        sapo_by_hand(2.0, 1.0, 0.5, 4.0)[0],
        sapo_by_hand(2.0, -1.0, 0.5, 4.0)[0],
        -4.0 / 0.5 * 0.5,
        0.5,
    ]
    assert_close(loss, torch.tensor([[*expected, 0.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # at ρ = 2 the τ=4 gate (negative advantage) passes far less gradient than the τ=0.5 one
    assert abs(grad[0, 1]) < 0.1 * abs(grad[0, 0])
    # at ρ = 1 the gradient is −A whatever τ: PPO's on-policy gradient
    assert_close(grad[0, 2:4], torch.tensor([-1.0, 1.0]))


def test_sapo_equals_ppo_gradient_on_policy():
    gen = torch.Generator().manual_seed(11)
    logp = (torch.randn(3, 6, generator=gen) - 1).requires_grad_()
    adv = torch.randn(3, 6, generator=gen)
    mask = torch.rand(3, 6, generator=gen) > 0.3
    old = logp.detach()
    (g_sapo,) = torch.autograd.grad(sapo_policy_loss(logp, old, adv, mask)[0].sum(), logp)
    (g_ppo,) = torch.autograd.grad(ppo_policy_loss(logp, old, adv, mask)[0].sum(), logp)
    assert_close(g_sapo, g_ppo)
    assert g_sapo.abs().sum() > 0


def test_both_refuse_dual_clip():
    for loss_fn in (cispo_policy_loss, sapo_policy_loss):
        with pytest.raises(ValueError, match="dual_clip"):
            loss_fn(logp_for([1.0] * 4), OLD, torch.ones(1, 5), MASK, 0.2, 0.2, 3.0)


# ---- aggregation and the mismatch corrections ----------------------------------------------------------


def test_default_aggregations_cispo_token_sapo_sequence():
    assert DEFAULT_AGGREGATION["cispo"] == "token" and DEFAULT_AGGREGATION["sapo"] == "sequence"
    logp = torch.tensor([[0.0, 0.0], [0.0, 0.0]], requires_grad=True)  # ρ = 1
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    per_token, _ = sapo_policy_loss(logp, torch.zeros(2, 2), adv, mask)
    # ρ = 1: −2A/τ per token; row 0: −2, row 1: 2/1.05; each sequence weighs 1/2
    assert_close(aggregate_loss(per_token, mask, loss_aggregation("sapo")), torch.tensor((-2 + 2 / 1.05) / 2))
    logp2 = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])
    per_token, _ = cispo_policy_loss(logp2, logp2, 2 * adv, mask)  # on-policy: the REINFORCE loss −A·log π
    # −A·log π = 2, 4 and −6: every token weighs 1/3
    assert_close(aggregate_loss(per_token, mask, loss_aggregation("cispo")), torch.tensor((2 + 4 - 6) / 3))


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
@pytest.mark.parametrize("correction", ["tis", "icepop"])
def test_token_corrections_multiply_the_per_token_loss(loss_type, correction):
    gen = torch.Generator().manual_seed(3)
    logp = (torch.randn(4, 6, generator=gen) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(4, 6, generator=gen) * 0.3
    rollout = old + torch.randn(4, 6, generator=gen) * 0.8  # wide: some weights fall outside [0.5, 5]
    adv = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.2
    low, high = (0.2, 0.28) if loss_type == "cispo" else (1.0, 1.05)
    params = ClipParams(low, high) if loss_type == "cispo" else SapoParams(low, high)
    corrected, stats = corrected_policy_loss(loss_type, logp, old, adv, mask, params, rollout, correction)
    plain, _ = POLICY_LOSSES[loss_type](logp, old, adv, mask, low, high)
    w = torch.exp(old - rollout)
    w = w.clamp(0.5, 5.0) if correction == "tis" else torch.where((w >= 0.5) & (w <= 5.0), w, 0.0)
    assert_close(corrected, plain * w * mask)
    assert 0 < stats["mismatch_clip_ratio"] < 1  # the bounds did bite


# ---- flags: choices, defaults and refusals ---------------------------------------------------------------


def parse(*argv) -> AlgorithmConfig:
    parser = argparse.ArgumentParser()
    add_config_group(parser, AlgorithmConfig, "algorithm")
    return config_from_args(AlgorithmConfig, parser.parse_args(list(argv)))


def test_flag_round_trip_reaches_the_registered_loss():
    cispo = parse("--policy_loss_type", "cispo", "--eps_clip_low_high", "1.0", "0.28")
    assert POLICY_LOSSES[cispo.policy_loss_type] is cispo_policy_loss
    assert cispo.clip_bounds == (1.0, 0.28) and cispo.loss_aggregation == "token"
    assert cispo.policy_loss_params() == ClipParams(1.0, 0.28)
    assert parse("--policy_loss_type", "cispo").clip_bounds == (0.2, 0.2)  # --eps_clip's default
    sapo = parse("--policy_loss_type", "sapo")
    assert POLICY_LOSSES[sapo.policy_loss_type] is sapo_policy_loss
    assert sapo.policy_loss_params() == SapoParams(1.0, 1.05) and sapo.loss_aggregation == "sequence"
    assert parse("--policy_loss_type", "sapo", "--tau_neg", "2").policy_loss_params() == SapoParams(1.0, 2.0)
    assert parse("--policy_loss_type", "sapo", "--loss_agg_mode", "token").loss_aggregation == "token"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy_loss_type", "cispo", "--dual_clip", "3"], "--dual_clip with --policy_loss_type cispo"),
        (["--policy_loss_type", "sapo", "--dual_clip", "3"], "--dual_clip with --policy_loss_type sapo"),
        (["--policy_loss_type", "sapo", "--eps_clip", "0.3"], "SAPO has no clip"),
        (["--policy_loss_type", "sapo", "--eps_clip_low_high", "0.2", "0.3"], "SAPO has no clip"),
        (["--tau_pos", "2"], "not used by --policy_loss_type ppo"),
        (["--policy_loss_type", "cispo", "--tau_neg", "2"], "not used by --policy_loss_type cispo"),
        (["--policy_loss_type", "sapo", "--tau_pos", "0"], "--tau_pos must be > 0"),
    ],
)
def test_meaningless_combinations_are_refused_in_one_line(argv, message):
    with pytest.raises(ConfigError) as exc:
        parse(*argv)
    assert message in str(exc.value) and "\n" not in str(exc.value)
