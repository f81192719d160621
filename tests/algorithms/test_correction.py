"""Rollout/trainer mismatch correction: TIS truncation, ICEPOP masking, and how each policy loss
takes the correction (PPO: token weights; GSPO: the rollout log-probs inside the sequence ratio)."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms import ClipParams, aggregate_loss, ppo_policy_loss
from tidal.algorithms.correction import (
    MISMATCH_CORRECTIONS,
    corrected_policy_loss,
    icepop_weights,
    tis_weights,
)

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


# One sequence of two action tokens (plus padding): π = π_old, the engine sampled with
# log π_rollout = log π − [0.1, 0.3], so the token weights are w = [e^0.1, e^0.3] and GSPO's sequence
# ratio against the rollout is s = exp(mean(0.1, 0.3)) = e^0.2 ≈ 1.2214.
LOGP = torch.tensor([[-1.0, -2.0, 0.0]])
ROLLOUT_LOGP = torch.tensor([[-1.1, -2.3, 0.0]])
SEQ_MASK = torch.tensor([[1, 1, 0]])


def test_gspo_correction_puts_the_rollout_ratio_inside_the_sequence_ratio():
    """OpenRLHF's GSPO: log-ratio against the rollout, no token weights (the old code gave
    per-token loss × w = [e^0.1, e^0.3] = [1.105, 1.350] for A = −1)."""
    s = math.exp(0.2)
    logp = LOGP.clone().requires_grad_()
    negative = torch.tensor([[-1.0, -1.0, 0.0]])
    loss, stats = corrected_policy_loss(
        "gspo",
        logp,
        LOGP,
        negative,
        SEQ_MASK,
        ClipParams(0.2, 0.2),
        rollout_logp=ROLLOUT_LOGP,
        correction="tis",
    )
    assert_close(loss, torch.tensor([[s, s, 0.0]]))  # −min(s·A, clip(s)·A) with A = −1: s unclipped
    assert_close(stats["mismatch_weight"], torch.tensor((math.exp(0.1) + math.exp(0.3)) / 2))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, torch.tensor([[s, s, 0.0]]))  # GSPO-token: ∂/∂logπ_t of the per-token loss is s
    # A = +1: s = 1.2214 > 1 + ε, the clipped branch (1.2) wins and the sequence gets no gradient
    loss, stats = corrected_policy_loss(
        "gspo",
        logp,
        LOGP,
        -negative,
        SEQ_MASK,
        ClipParams(0.2, 0.2),
        rollout_logp=ROLLOUT_LOGP,
        correction="icepop",
    )
    assert_close(loss, torch.tensor([[-1.2, -1.2, 0.0]]))
    assert_close(stats["clip_ratio"], torch.tensor(1.0))
    # the tis/icepop bounds do not enter: the sequence ratio's clip bounds the correction
    narrow, _ = corrected_policy_loss(
        "gspo", LOGP, LOGP, negative, SEQ_MASK, ClipParams(0.2, 0.2), ROLLOUT_LOGP, "tis", (0.0, 1.0)
    )
    assert_close(narrow, torch.tensor([[s, s, 0.0]]))


def test_gspo_correction_matches_openrlhf_sequence_ratio():
    """OpenRLHF v0.9.2 ``PolicyLoss`` for gspo with correction: ratio = exp(masked mean of
    log π − log π_rollout), surrogate −min(ρA, clip(ρ)A), sequence-mean aggregation."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=g) * 0.1 - 1
    old = logp + torch.randn(4, 6, generator=g) * 0.01
    rollout = logp + torch.randn(4, 6, generator=g) * 0.01
    mask = (torch.arange(6)[None] < torch.tensor([[6], [4], [5], [2]])).long()
    adv = torch.randn(4, 1, generator=g).expand(4, 6) * mask
    loss, _ = corrected_policy_loss("gspo", logp, old, adv, mask, ClipParams(3e-4, 4e-4), rollout, "tis")
    ratio = (((logp - rollout) * mask).sum(-1) / mask.sum(-1)).exp().unsqueeze(-1) * mask
    reference = -torch.min(ratio * adv, ratio.clamp(1 - 3e-4, 1 + 4e-4) * adv)
    assert_close(aggregate_loss(loss, mask, "sequence"), ((reference * mask).sum(-1) / mask.sum(-1)).mean())


def test_ppo_correction_multiplies_the_token_loss_by_the_weights():
    logp = torch.tensor([[-1.0, -2.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0]])
    plain, _ = ppo_policy_loss(logp, LOGP, adv, SEQ_MASK)
    for name, bounds in (("tis", (0.0, 1.2)), ("icepop", (0.5, 1.2))):
        weights, _ = MISMATCH_CORRECTIONS[name](LOGP, ROLLOUT_LOGP, SEQ_MASK, *bounds)
        loss, stats = corrected_policy_loss(
            "ppo", logp, LOGP, adv, SEQ_MASK, ClipParams(0.2, 0.2), ROLLOUT_LOGP, name, bounds
        )
        assert_close(loss, plain * weights)
        assert "mismatch_clip_ratio" in stats
    # e^0.3 = 1.35 is truncated to 1.2 (tis) or dropped (icepop)
    tis, _ = corrected_policy_loss(
        "ppo", logp, LOGP, adv, SEQ_MASK, ClipParams(0.2, 0.2), ROLLOUT_LOGP, "tis", (0, 1.2)
    )
    assert_close(tis, torch.tensor([[-math.exp(0.1), 1.2, 0.0]]))
    off, _ = corrected_policy_loss("ppo", logp, LOGP, adv, SEQ_MASK, ClipParams(0.2, 0.2))
    assert_close(off, plain)


def test_icepop_with_gspo_is_refused_not_ignored():
    from tidal.config import ConfigError
    from tidal.config.rl import AlgorithmConfig

    AlgorithmConfig(policy_loss_type="gspo", enable_vllm_is_correction=True)  # GSPO's own correction: fine
    with pytest.raises(ConfigError, match="--use_icepop with --policy_loss_type gspo"):
        AlgorithmConfig(policy_loss_type="gspo", enable_vllm_is_correction=True, use_icepop=True)
